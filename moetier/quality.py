"""The quality harness (`moetier eval`): what an approximating configuration costs against exact mode, measured in
the engine on held-out text.

For each text (a domain: prose, code), `windows` windows of `window` tokens spread evenly over it are scored
teacher-forced (moetier/engine/score.py): a prefill of `prefix` tokens, then one decode step per token, `batch`
windows of a domain decoded together (SMoE's batch-aware substitution acts across them). Per configuration and
domain:

- perplexity: exp of the mean negative log-likelihood of the true next tokens;
- top-1 agreement: the share of positions whose most likely next token equals exact mode's;
- KL: the mean KL(exact ‖ configuration) of the next-token distributions, in nats;
- speed: decode tokens per second over the scored steps, and expert bytes read per decoded token.

Exact mode is run first, at the same expert budget: its distributions are the reference and its speed the
baseline every row is divided by."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch

from moetier.errors import BudgetError, MoetierError


@dataclass(frozen=True)
class Windows:
    """Token windows of one domain."""

    domain: str
    rows: tuple[tuple[int, ...], ...]

    @classmethod
    def spread(cls, domain: str, ids: list[int], window: int, count: int) -> Windows:
        """`count` windows of `window` tokens starting evenly over `ids` (fewer if the text is short)."""
        if len(ids) < window:
            raise MoetierError(f"the {domain} text has {len(ids)} tokens, fewer than one window of {window}",
                               hint="give a longer text or a smaller --window")
        starts = np.linspace(0, len(ids) - window, num=min(count, len(ids) // window)).astype(int)
        return cls(domain, tuple(tuple(ids[s:s + window]) for s in dict.fromkeys(starts.tolist())))


@dataclass
class DomainScore:
    domain: str
    tokens: int = 0
    nll: float = 0.0  # summed over tokens
    agree: int = 0
    kl: float = 0.0  # summed over tokens

    def add(self, logp: torch.Tensor, exact: torch.Tensor, targets: torch.Tensor) -> None:
        """logp, exact: [N, V] log-probabilities; targets: [N] the true next tokens."""
        self.tokens += len(targets)
        self.nll -= logp.gather(1, targets[:, None]).sum().item()
        self.agree += int((logp.argmax(1) == exact.argmax(1)).sum())
        self.kl += float((exact.exp() * (exact - logp)).sum())

    def summary(self) -> dict:
        n = max(1, self.tokens)
        return {"domain": self.domain, "tokens": self.tokens, "perplexity": float(np.exp(self.nll / n)),
                "top1_agreement": self.agree / n, "kl": self.kl / n}


@dataclass
class Row:
    """One configuration's quality and speed."""

    label: str
    domains: list[dict]
    decode_tokens_per_s: float
    expert_bytes_per_token: float
    hit_rate: float | None
    low_share: float  # of the needed experts in decode steps, computed below the high precision
    skipped: int
    substituted: int = 0  # decode (token, k) assignments given another expert than the router's
    note: str = ""  # why a configuration did not run (its budget cannot hold it)

    def to_json(self) -> dict:
        return asdict(self)


def score(engine, windows: list[Windows], prefix: int, exact: dict | None = None,
          progress: Callable[[int], None] = lambda n: None, batch: int = 1) -> tuple[Row, dict]:
    """Score every window with `engine`, `batch` windows of a domain at a time. `exact`: exact mode's
    log-probabilities per (domain, window index), from an earlier call (None: this is exact mode, and its own are
    returned for the calls that follow). `progress(n)`: n more windows scored."""
    from moetier.engine.score import teacher_forced

    logps, scores = {}, []
    seconds = tokens = bytes_read = needed = hits = low = skipped = substituted = 0
    for w in windows:
        s = DomainScore(w.domain)
        for first in range(0, len(w.rows), batch):
            rows = [list(row) for row in w.rows[first:first + batch]]
            logp, stats = teacher_forced(engine, rows, prefix)  # [b, n, V]
            for i, row in enumerate(rows, start=first):
                reference = logp[i - first] if exact is None else exact[(w.domain, i)]
                s.add(logp[i - first], reference, torch.tensor(row[prefix:], dtype=torch.int64))
                logps[(w.domain, i)] = logp[i - first]
            dec = stats.phases[1]
            seconds += sum(stats.decode_step_s)
            tokens += stats.decode_tokens
            bytes_read, needed, hits = bytes_read + dec.bytes_read, needed + dec.needed, hits + dec.hits
            low, skipped, substituted = low + dec.low_runs, skipped + dec.skipped, substituted + dec.substituted
            progress(len(rows))
        scores.append(s.summary())
    row = Row("", scores, tokens / seconds if seconds else 0.0, bytes_read / max(1, tokens),
              hits / needed if needed else None, low / max(1, needed), skipped, substituted)
    return row, logps


def sweep(make_engine: Callable[[str], object], labels: list[str], windows: list[Windows], prefix: int,
          progress: Callable[[int], None] = lambda n: None, batch: int = 1) -> Iterator[Row]:
    """Exact mode (`labels[0]`), then every other label: `make_engine(label)` opens the engine of a point. A point
    the budget cannot hold (low-tier on a small budget) is a row with its reason, not an end to the sweep."""
    exact = None
    for label in labels:
        try:
            engine = make_engine(label)
        except BudgetError as e:
            if exact is None:
                raise
            yield Row(label, [], 0.0, 0.0, None, 0.0, 0, note=str(e).splitlines()[0])
            continue
        with engine:
            row, logps = score(engine, windows, prefix, exact, progress, batch)
        if exact is None:
            exact = logps
        row.label = label
        yield row
