"""Least high-precision used (HOBBIT §3.4): like LFU, but only uses at the run's high precision count (the
model's own, or int8 in the int8+int2 pair: `PolicyContext.high_precision`), so an expert mostly served at low
precision is cheap to lose. Counts are the sequence's (Eq. 3's H_t: the records reset with each sequence, as
HOBBIT's do). Without mixed precision it is per-sequence LFU. Ties: least recent."""

from __future__ import annotations

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.scored import ScoredPolicy


class LHUPolicy(ScoredPolicy):
    name = "lhu"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.high_uses: dict[ExpertKey, int] = {}

    def on_sequence_start(self) -> None:
        self.high_uses.clear()

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        super().on_access(key, precision, step)
        if self.ctx.is_high(precision):
            self.high_uses[key] = self.high_uses.get(key, 0) + 1

    def priority(self, key: ExpertKey) -> float:
        return self.high_uses.get(key, 0)
