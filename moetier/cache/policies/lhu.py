"""Least high-precision used (HOBBIT): like LFU, but only uses at full precision count, so an expert that is
mostly served at low precision is cheap to lose. Without mixed precision it is LFU. Ties: least recent."""

from __future__ import annotations

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.scored import ScoredPolicy

LOW_PRECISIONS = frozenset({"int8", "int4", "int3", "int2"})


class LHUPolicy(ScoredPolicy):
    name = "lhu"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.high_uses: dict[ExpertKey, int] = {}

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        super().on_access(key, precision, step)
        if precision not in LOW_PRECISIONS:
            self.high_uses[key] = self.high_uses.get(key, 0) + 1

    def priority(self, key: ExpertKey) -> float:
        return self.high_uses.get(key, 0)
