"""The model's tokenizer (tokenizer.json through the `tokenizers` library), with incremental detokenising."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from moetier.engine.chat_template import ChatTemplate
from moetier.engine.grammar import GrammarTokenizer
from moetier.errors import ModelNotFoundError, StoreError, parsing
from moetier.store.format import DAMAGED


class Tokenizer:
    def __init__(self, tokenizer_json: str, settings: dict | None = None, bos_token_id: int | None = None,
                 chat_template: str | None = None) -> None:
        """`tokenizer_json`: the text of tokenizer.json; `settings`: tokenizer_config.json's, if any;
        `chat_template`: chat_template.jinja's text, if the model has one (else tokenizer_config.json's)."""
        try:
            self._tok = HFTokenizer.from_str(tokenizer_json)
        except Exception as e:  # the tokenizers library raises its own exception type
            raise StoreError(f"cannot read the tokenizer: {e}", hint=DAMAGED) from None
        settings = settings if isinstance(settings, dict) else {}
        self.add_bos = bool(settings.get("add_bos_token", False)) and bos_token_id is not None
        self.bos_token_id = bos_token_id
        self.chat_template = ChatTemplate.from_settings(settings, chat_template)  # None: the model has none
        self._grammar_vocabularies: dict[tuple, GrammarTokenizer] = {}

    @classmethod
    def from_file(cls, path: Path, bos_token_id: int | None = None) -> Tokenizer:
        config, jinja = path.parent / "tokenizer_config.json", path.parent / "chat_template.jinja"
        settings = json.loads(config.read_text()) if config.exists() else None
        return cls(path.read_text(encoding="utf-8"), settings, bos_token_id,
                   jinja.read_text(encoding="utf-8") if jinja.exists() else None)

    @classmethod
    def from_store(cls, store) -> Tokenizer:
        """The store's tokenizer, its files verified against the manifest's checksums."""
        if store.tokenizer_path is None:
            raise ModelNotFoundError(f"{store.path} has no tokenizer.json",
                                     hint="pass token ids instead of text, or add the model's tokenizer.json")
        settings = None
        if (store.path / "tokenizer_config.json").exists():
            with parsing(str(store.path / "tokenizer_config.json"), StoreError, hint=DAMAGED):
                settings = json.loads(store.read_file("tokenizer_config.json"))
        text = store.read_file("tokenizer.json").decode("utf-8", errors="replace")
        jinja = (store.read_file("chat_template.jinja").decode("utf-8", errors="replace")
                 if (store.path / "chat_template.jinja").exists() else None)
        return cls(text, settings, store.spec.bos_token_id, jinja)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """`add_bos` False: the text as it is (a rendered chat template writes its own BOS where it wants one)."""
        ids = self._tok.encode(text, add_special_tokens=add_bos).ids
        if add_bos and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def to_json(self) -> str:
        """tokenizer.json's text, as the tokenizers library writes it back."""
        return self._tok.to_str()

    def grammar_vocabulary(self, vocab_size: int, eos: Iterable[int]) -> GrammarTokenizer:
        """The vocabulary as a grammar reads it over `vocab_size` logits: made once (its cost grows with the
        vocabulary) and kept, for every scheduler of this tokenizer's engine — each `generate` call makes one."""
        key = (vocab_size, tuple(sorted(eos)))
        if key not in self._grammar_vocabularies:
            self._grammar_vocabularies[key] = GrammarTokenizer(self.to_json(), vocab_size, list(key[1]))
        return self._grammar_vocabularies[key]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decode_token(self, token: int) -> str:
        """One token's own text, special tokens included (a log-probability's label)."""
        return self._tok.decode([token], skip_special_tokens=False)


class TextStream:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.emitted = 0

    def delta(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids)
        if text.endswith("\ufffd"):
            return ""
        out, self.emitted = text[self.emitted:], len(text)
        return out
