"""Least high-precision used (HOBBIT §3.4): like LFU, but only uses at the run's high precision count (the
model's own, or int8 in the int8+int2 pair: `PolicyContext.high_precision`), so an expert mostly served at low
precision is cheap to lose. Counts are the sequence's (Eq. 3's H_t: the records reset with each sequence, as
HOBBIT's do). Without mixed precision it is per-sequence LFU. Ties: least recent. Counted in an array
(ArrayScoredPolicy): a victim is a sort of the residents, not a scan."""

from __future__ import annotations

import numpy as np

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.arrayed import ArrayScoredPolicy


class LHUPolicy(ArrayScoredPolicy):
    name = "lhu"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.high_uses = np.zeros(self.held.shape, dtype=np.int64)  # [L, E] this sequence's

    def on_sequence_start(self) -> None:
        self.high_uses[:] = 0

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        super().on_access(key, precision, step)
        if self.ctx.is_high(precision):
            self.high_uses[self.row[key.layer], key.expert] += 1

    def priority(self, key: ExpertKey) -> float:
        return int(self.high_uses[self.row[key.layer], key.expert])

    def priorities(self) -> np.ndarray:
        return self.high_uses
