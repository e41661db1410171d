"""Constrained decoding: a request's output held to a grammar — a JSON value, a JSON schema, a tool call's shape — by
llguidance (the Rust library behind llama.cpp's and vLLM's guided decoding). Before each token is drawn the grammar's
matcher says which tokens may come next and the others' logits become -inf; the token drawn is fed back to it; the
request ends when the grammar is complete (or at end-of-sequence, which the matcher allows only where the text so
far is a whole match).

`Grammar` is what a request asks for (checked when made, before any work); `Matcher` is one request's position in
it, over the model's vocabulary (`GrammarTokenizer`, made once an engine, about 0.05 s for a 8 K vocabulary). JSON is
written compactly, as `json.dumps` writes it (", " and ": ", no other whitespace): a grammar that allows any
whitespace lets a model wander in it until its token budget ends."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

from moetier.errors import MoetierError

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(MoetierError):
    pass


def _llguidance():
    try:
        import llguidance
    except ImportError:  # (a dependency: only a broken install lacks it)
        raise GrammarError("constrained decoding needs llguidance", hint="pip install llguidance") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A grammar in llguidance's form (its JSON: a JSON schema, or Lark with `%json {...}` pieces), checked here."""

    text: str
    name: str  # what it holds, for messages ("JSON", "the JSON schema 'weather'", "a call of get_weather")

    def __post_init__(self) -> None:
        error = _llguidance().LLMatcher.validate_grammar(self.text)
        if error:
            raise GrammarError(f"{self.name} is not a grammar moetier can hold output to: {error}")

    @classmethod
    def json_schema(cls, schema: dict, name: str = "the JSON schema") -> Grammar:
        if not isinstance(schema, dict):
            raise GrammarError(f"{name} must be a JSON object, got {type(schema).__name__}")
        return cls(_llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE), name)

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's JSON mode)."""
        return cls.json_schema({"type": "object"}, "a JSON object")

    @classmethod
    def lark(cls, text: str, name: str) -> Grammar:
        """Lark, with llguidance's `%json {schema}` for a JSON piece (written as JSON_STYLE says)."""
        return cls(_llguidance().LLMatcher.grammar_from_lark(text), name)


def json_piece(schema: dict) -> str:
    """A Lark rule body holding a JSON value to `schema`, compact (JSON_STYLE)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


class GrammarTokenizer:
    """The model's vocabulary as llguidance sees it: `tokenizer_json` (tokenizer.json's text) over `vocab_size`
    logits (the model's, which may be larger than the tokenizer's), `eos` its end-of-sequence ids."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int]) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_str(tokenizer_json)
        tok.no_padding()  # (llguidance reads the tokenizer as it encodes one text)
        tok.no_truncation()
        self.vocab_size = vocab_size
        self.ll = _llguidance().LLTokenizer(tok.to_str(), n_vocab=vocab_size, eos_token=eos or None)


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, grammar: Grammar, tokenizer: GrammarTokenizer) -> None:
        self.grammar = grammar
        self.m = _llguidance().LLMatcher(tokenizer.ll, grammar.text)
        if self.m.is_error():
            raise GrammarError(f"{grammar.name}: {self.m.get_error()}")
        self.vocab_size = tokenizer.vocab_size
        self.bits = np.zeros((tokenizer.vocab_size + 31) // 32, np.int32)  # one bit a token, filled each step

    def allowed(self) -> np.ndarray:
        """[V] bool: the tokens that may come next."""
        self.m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        return np.unpackbits(self.bits.view(np.uint8), bitorder="little")[:self.vocab_size].view(bool)

    def mask_(self, logits: torch.Tensor) -> None:
        """logits [V], in place: every token the grammar does not allow next at -inf."""
        allowed = self.allowed()
        if not allowed.any():  # (a matcher in error: no token could be drawn)
            raise GrammarError(f"{self.grammar.name}: no token may come next ({self.m.get_error() or 'stopped'})")
        logits.masked_fill_(torch.from_numpy(~allowed).to(logits.device), float("-inf"))

    def accept(self, token: int) -> None:
        """The token drawn (one the mask allowed: anything else is a fault of the caller)."""
        if not self.m.consume_token(token):
            raise GrammarError(f"token {token} breaks {self.grammar.name}: {self.m.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing may follow but end-of-sequence."""
        return self.m.is_stopped()
