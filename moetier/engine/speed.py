"""Prompt processing and generation speed as llama-bench measures them (`moetier bench`): a `pp N` test prefills N
random token ids and takes N over the time to the first token; a `tg N` test decodes N tokens after a one-token
prompt and takes the decode steps' tokens over their time (llama-bench's tg counts its first token too; ours is the
prefill's, so it is left out). Each test runs once to warm (the expert cache filled as the test's own routing
fills it, scratch sized, pages touched), then `repetitions` times, each with new ids so that nothing is reused;
tokens/s are given as their mean and standard deviation, as llama-bench gives them. With `batch` B a `tg` test
decodes B sequences together, its tokens/s over all of them (llama-batched-bench's S_TG)."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from moetier.errors import MoetierError


@dataclass(frozen=True)
class SpeedTest:
    kind: str  # "pp": prompt processing; "tg": text generation
    tokens: int
    batch: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("pp", "tg"):
            raise MoetierError(f"unknown speed test {self.kind!r}", hint="pp (a prompt) or tg (generation)")
        if self.tokens < 1 or self.batch < 1:
            raise MoetierError(f"a speed test needs at least one token and one sequence, got {self.tokens} and "
                               f"{self.batch}")
        if self.kind == "pp" and self.batch != 1:
            raise MoetierError("a pp test prefills one prompt", hint="--batch applies to the tg tests")

    @property
    def name(self) -> str:
        return f"{self.kind}{self.tokens}" + (f" x{self.batch}" if self.batch > 1 else "")


@dataclass(frozen=True)
class SpeedResult:
    test: SpeedTest
    samples: tuple[float, ...]  # tokens/s of each measured repetition

    def __post_init__(self) -> None:
        if not self.samples or min(self.samples) <= 0:
            raise ValueError(f"{self.test.name}: no positive sample in {self.samples}")

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def std(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0

    def row(self) -> dict:
        return {"test": self.test.name, "kind": self.test.kind, "tokens": self.test.tokens, "batch": self.test.batch,
                "tokens_per_s": self.mean, "std": self.std, "samples": list(self.samples)}


def _ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def sample(engine, test: SpeedTest, rng: random.Random) -> float:
    """One run of `test` on `engine`: its tokens/s."""
    vocab = engine.spec.vocab_size
    if test.kind == "pp":
        stats = engine.generate([_ids(rng, vocab, test.tokens)], max_new_tokens=1, ignore_eos=True).stats
        return test.tokens / stats["ttft_s"]
    prompts = [_ids(rng, vocab, 1) for _ in range(test.batch)]
    # (one more token than measured: the first comes from the prefill, outside the decode steps timed)
    stats = engine.generate(prompts, max_new_tokens=test.tokens + 1, ignore_eos=True).stats
    return stats["decode_tokens_per_s"]


def measure(engine, test: SpeedTest, repetitions: int, seed: int = 0, on_sample=None) -> SpeedResult:
    """`test` run once to warm, then `repetitions` times (`on_sample()` after each run, the warm one included)."""
    if repetitions < 1:
        raise MoetierError(f"repetitions must be at least 1, got {repetitions}")
    rng = random.Random(seed)
    samples = []
    for i in range(1 + repetitions):
        tok_s = sample(engine, test, rng)
        if i:
            samples.append(tok_s)
        if on_sample is not None:
            on_sample()
    return SpeedResult(test, tuple(samples))
