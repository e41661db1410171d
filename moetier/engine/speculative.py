"""Speculative decoding by prompt lookup, for offloaded experts: a running request's next tokens are guessed from its
own context (the longest recent n-gram that occurred before: what follows it then is the draft), and the request's
last token and its draft run through the model in one step. Under a small expert budget a decode step's cost is its
expert reads, and a step of k + 1 tokens reads the union of their experts once — so where those tokens share experts
or find them cached (text that repeats within what the cache holds), an accepted draft of k tokens pays about one
step's reads instead of k + 1; where each token needs experts of its own, a draft token costs what a plain step
does and the gate turns drafting off (docs/serving.md measures both).

Exact: greedy requests keep a draft token where it is the model's own argmax at its position, and then take the
model's token at the first miss (or after the last draft) — the tokens plain decoding writes. Sampled requests take
the standard rejection rule with a draft as a one-point proposal: draft token d is kept with the probability p(d)
the request's sampling gives it there; at the first rejection the token is drawn from p without d (renormalised);
with every draft kept, one more is drawn from the last position — each token distributed as plain sampling's.
Requests with penalties (their logits depend on the tokens before, drafts included) or a grammar decode plainly.

Gated per request (`Gate`): a verify step costs more than a plain one (more tokens to compute; under offload, the
drafts' own experts), so each request verifies the number of draft tokens that maximises the tokens a step yields
(from its measured acceptance) per its cost (from the measured cost of a draft token, `StepCosts`), and none where
that does not beat a plain step; a request that stopped tries one draft token every `probe_every` steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from moetier.errors import MoetierError


@dataclass(frozen=True)
class Speculation:
    tokens: int = 4  # drafted a step, at most (k)
    max_ngram: int = 3  # the longest context suffix looked up
    min_ngram: int = 1
    probe_every: int = 32  # plain steps between tries, once drafting stopped paying
    # drafting goes on while tokens a verify step / its cost exceed this: the two are estimates (a step's cost varies
    # with the experts its tokens need), and a draft that only just pays by them loses as often as it wins
    margin: float = 1.15

    def __post_init__(self) -> None:
        if not 1 <= self.tokens <= 16:
            raise MoetierError(f"speculation drafts 1..16 tokens a step, got {self.tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram <= 8:
            raise MoetierError(f"n-gram lengths must satisfy 1 <= min <= max <= 8, got {self.min_ngram}, "
                               f"{self.max_ngram}")
        if self.probe_every < 1 or self.margin < 1:
            raise MoetierError("probe_every must be at least 1 and margin at least 1")


class Draft(NamedTuple):
    tokens: list[int]
    ngram: int  # the length of the context's suffix it was found by (0: none found)


class NgramIndex:
    """One request's context with, for each n-gram length, where each n-gram last occurred before the context's
    end (the position of the token after it): O(max n) a token to keep, O(max n) to draft — no scan."""

    def __init__(self, spec: Speculation, context: list[int]) -> None:
        self.spec, self.tokens = spec, []
        self.after: list[dict[tuple[int, ...], int]] = [{} for _ in range(spec.max_ngram + 1)]  # by n
        self.extend(context)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            i = len(self.tokens)  # t's position: the n-grams ending just before it are followed by it
            for n in range(self.spec.min_ngram, self.spec.max_ngram + 1):
                if i >= n:
                    self.after[n][tuple(self.tokens[i - n:i])] = i
            self.tokens.append(t)

    def draft(self) -> Draft:
        """What followed the longest suffix of the context that occurred before (`tokens` of it), or none. Where that
        runs into the context's end the draft goes on copying itself: text that came back after `end - at` tokens
        (a loop, a list that goes on) is guessed to come back again after as many (as LZ77 copies overlap)."""
        end = len(self.tokens)
        for n in range(min(self.spec.max_ngram, end), self.spec.min_ngram - 1, -1):
            at = self.after[n].get(tuple(self.tokens[end - n:]))
            if at is not None:
                period = end - at
                return Draft([self.tokens[at + j % period] for j in range(self.spec.tokens)], n)
        return Draft([], 0)


class StepCosts:
    """What a step costs, on the engine's own clock: a plain decode step's seconds and the marginal cost `c` of a
    drafted token in a verify step, in plain steps (a verify step of k drafts a request costs about 1 + c·k plain
    ones: c near 0 where the step's fixed work dominates, near 1 where each token's expert reads do) — exponential
    averages, each None until first measured: the first decode step is a plain one, the first verify step drafts
    one token (Gate), to measure."""

    def __init__(self, weight: float = 0.3) -> None:
        self.weight = weight
        self.plain_s: float | None = None
        self.c: float | None = None

    def heard_plain(self, seconds: float) -> None:
        self.plain_s = seconds if self.plain_s is None else (1 - self.weight) * self.plain_s + self.weight * seconds

    def heard_verify(self, seconds: float, drafts_per_request: float) -> None:
        if self.plain_s is None or drafts_per_request <= 0:
            return
        seen = max(0.0, (seconds / self.plain_s - 1) / drafts_per_request)
        self.c = seen if self.c is None else (1 - self.weight) * self.c + self.weight * seen


def expected_tokens(accept: float, k: int) -> float:
    """Tokens a verify step of k drafts yields when each draft is kept with probability `accept` (the model's own
    token after the last kept draft counts): 1 + a + a² + ... + a^k."""
    return sum(accept ** i for i in range(k + 1))


class Rate:
    """A draft token's chance of being kept, where the drafts before it were, counted as a geometric rate: a verify
    step that kept m of its k drafts saw m tokens kept and, where m < k, one refused (the drafts after the first
    refusal say nothing; kept over drafted would read a 4-token draft kept 80% a token as 59%). The counts start
    from a prior of PRIOR_ACCEPT worth PRIOR_WEIGHT drafts, so one early refusal does not shut the gate, and fade by
    FADE a verify step, so the rate follows text that stops or starts repeating."""

    PRIOR_ACCEPT = 0.8  # (prompt lookup's drafts on repeating text are mostly right: try them)
    PRIOR_WEIGHT = 4.0
    FADE = 0.9

    def __init__(self) -> None:
        self.kept = self.PRIOR_ACCEPT * self.PRIOR_WEIGHT  # drafts kept, faded
        self.refused = (1 - self.PRIOR_ACCEPT) * self.PRIOR_WEIGHT  # first refusals, faded

    @property
    def accept(self) -> float:
        return self.kept / (self.kept + self.refused)

    def heard(self, drafted: int, kept: int) -> None:
        self.kept = self.FADE * self.kept + kept
        self.refused = self.FADE * self.refused + (kept < drafted)


class Gate:
    """One request's: how many of its drafted tokens to verify this step — the k that maximises tokens yielded per
    cost, E(k) / (1 + c·k), if that beats a plain step by `margin`; else none, and every `probe_every` plain steps
    one draft token anyway, to measure again (a budget that grew, text that began to repeat).

    The chance a draft token is kept is counted apart for each length of the n-gram that found the draft (`Rate`):
    a draft found by the last three tokens is kept far more often than one found by the last token alone (on
    demo-deep-xl's prose 86% against 43%), and a request may draft on the one and not the other."""

    def __init__(self, spec: Speculation) -> None:
        self.spec = spec
        self.rates = [Rate() for _ in range(spec.max_ngram + 1)]  # by n-gram length
        self.plain_steps = 0  # since its last verify

    def length(self, draft: Draft, costs: StepCosts) -> int:
        available = len(draft.tokens)
        if costs.plain_s is None or available == 0:
            return 0
        if costs.c is None:  # what a draft token costs is not known yet: one, to measure it
            return 1
        accept = self.rates[draft.ngram].accept
        best, k = max((expected_tokens(accept, k) / (1 + costs.c * k), k) for k in range(1, available + 1))
        if best >= self.spec.margin:
            return k
        if self.plain_steps >= self.spec.probe_every:
            return 1
        self.plain_steps += 1
        return 0

    def heard(self, ngram: int, drafted: int, kept: int) -> None:
        """A verify step kept `kept` of the `drafted` draft tokens an `ngram`-token match found."""
        self.plain_steps = 0
        self.rates[ngram].heard(drafted, kept)
