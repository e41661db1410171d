"""What to do for one MoE layer: which experts run, which are already resident, which loads to issue."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.plan.route import RouteResult


@dataclass(frozen=True)
class Load:
    expert: int
    slot: int
    after: int | None = None  # an expert of this layer whose compute must finish before the slot is overwritten
    evicted: ExpertKey | None = None  # who left the slot, if anyone


class Hit(NamedTuple):
    expert: int
    slot: int


@dataclass
class LayerPlan:
    route: RouteResult
    counts: np.ndarray  # [E] tokens routed to each expert
    experts: list[int]  # distinct experts needed, ascending
    hits: list[Hit] = field(default_factory=list)  # resident when the layer needed them; computed first
    loads: list[Load] = field(default_factory=list)  # on-demand loads, computed in this order after the hits

    @property
    def layer(self) -> int:
        return self.route.layer

    @classmethod
    def from_route(cls, route: RouteResult, num_experts: int) -> LayerPlan:
        counts = np.bincount(route.topk_ids.ravel(), minlength=num_experts)
        return cls(route, counts, np.flatnonzero(counts).tolist())
