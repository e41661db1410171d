"""A request the scheduler serves: its prompt, how its tokens are sampled, what ends it, and what it has produced."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moetier.engine.grammar import Grammar, Matcher
from moetier.engine.sampling import SamplingParams
from moetier.engine.text_output import TextOutput
from moetier.errors import MoetierError

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
STOP, LENGTH, ABORT = "stop", "length", "abort"  # why a request ended, as OpenAI's finish_reason names them
MAX_LOGPROBS = 20  # alternatives per token, at most (OpenAI's limit)


@dataclass(frozen=True)
class RequestParams:
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()  # texts that end the output where they begin (not included); needs a tokenizer
    ignore_eos: bool = False
    logprobs: int | None = None  # each new token's log-probability and this many alternatives (None: none)
    echo_logprobs: bool = False  # every prompt token's log-probability too (its prefill runs alone, all logits)
    grammar: Grammar | None = None  # the output held to it (moetier/engine/grammar.py); needs a tokenizer

    def __post_init__(self) -> None:
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise MoetierError("a stop string must be non-empty text")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise MoetierError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (log-softmax of its raw logits, before temperature) and the
    `top` most likely tokens there, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: RequestParams
    generator: torch.Generator  # shared by requests sampled together (one `generate` call's), else its own
    status: str = WAITING
    row: int | None = None  # its KV-cache row while it runs
    position: int = 0  # where its newest token goes when it is fed back
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, if asked
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # the first is None (no context)
    text: TextOutput | None = None  # the output as text, where stop strings are looked for
    finish_reason: str | None = None
    stopped_at_context: bool = False  # the KV rows' length (the context window) ended it
    matcher: Matcher | None = None  # its place in params.grammar, if it has one

    @property
    def finished(self) -> bool:
        return self.status == FINISHED


@dataclass(frozen=True)
class StepOutput:
    """One request's new token of a step (`token` None: it was aborted and has none)."""

    request: Request
    token: int | None
    finished: bool
    logprob: TokenLogprob | None = None

    @property
    def id(self) -> int:
        return self.request.id
