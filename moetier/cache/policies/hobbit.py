"""HOBBIT's multidimensional policy: a weighted sum of four keep-priorities, each scaled to [0, 1] —
recency (LRU), frequency in the current sequence (LFU, which HOBBIT finds better per sequence), uses at full
precision (LHU) and nearness of the expert's layer in the forward pass (FLD). The weights are fitted by
minimising miss penalty on a calibration trace (`moetier train cache-policy --policy hobbit`) and saved with
the model (moetier/policy_files.py), and handed to the policy."""

from __future__ import annotations

from dataclasses import dataclass

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.lhu import LOW_PRECISIONS
from moetier.cache.policies.scored import ScoredPolicy
from moetier.errors import MoetierError


@dataclass(frozen=True)
class HobbitWeights:
    lru: float = 0.25
    lfu: float = 0.25
    lhu: float = 0.25
    fld: float = 0.25

    def __post_init__(self) -> None:
        if min(self.lru, self.lfu, self.lhu, self.fld) < 0 or self.lru + self.lfu + self.lhu + self.fld <= 0:
            raise MoetierError(f"HOBBIT weights must be non-negative and not all zero: {self}")


class HobbitPolicy(ScoredPolicy):
    name = "hobbit"

    def __init__(self, ctx: PolicyContext, weights: HobbitWeights) -> None:
        super().__init__(ctx)
        self.weights = weights
        self.uses: dict[ExpertKey, int] = {}  # this sequence
        self.high_uses: dict[ExpertKey, int] = {}
        self.max_uses = self.max_high_uses = 1

    def on_sequence_start(self) -> None:
        self.uses.clear()
        self.high_uses.clear()
        self.max_uses = self.max_high_uses = 1

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        super().on_access(key, precision, step)
        self.uses[key] = n = self.uses.get(key, 0) + 1
        self.max_uses = max(self.max_uses, n)
        if precision not in LOW_PRECISIONS:
            self.high_uses[key] = n = self.high_uses.get(key, 0) + 1
            self.max_high_uses = max(self.max_high_uses, n)

    def priority(self, key: ExpertKey) -> float:
        w = self.weights
        recency = self.last_use.get(key, 0) / max(1, self.clock)
        nearness = 1.0 - self.layer_distance(key) / max(1, self.ctx.num_layers - 1)
        return (w.lru * recency + w.lfu * self.uses.get(key, 0) / self.max_uses
                + w.lhu * self.high_uses.get(key, 0) / self.max_high_uses + w.fld * nearness)
