"""Belady's MIN, the offline optimum: evict the expert whose next use is farthest in the future (never used
again counts as farthest). It is handed the future it will face — for each expert, the times of its uses — by
whoever drives it from a trace (the simulator, `cache-bench`), so it is a bound there and never a policy for
live generation. Time is the position of a layer step: (step - 1) * layers + the layer's execution position.
Each expert's next use is kept in an array (ArrayScoredPolicy), moved on only for the experts whose kept next use
has passed — a layer step's few — so a victim is a sort of the residents, not a search of each one's future."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.arrayed import ArrayScoredPolicy
from moetier.cache.policies.context import PolicyContext
from moetier.errors import MoetierError

NEVER = float("inf")


class BeladyPolicy(ArrayScoredPolicy):
    name = "belady"

    def __init__(self, ctx: PolicyContext, future: Mapping[ExpertKey, Sequence[int]] | None = None) -> None:
        """`future`: for each expert, the ascending times of its uses."""
        super().__init__(ctx)
        if future is None:
            raise MoetierError("belady is the offline optimum: it needs the future it will face",
                               hint="use it in `moetier sim` or `moetier cache-bench`, not in live generation")
        self.uses = future
        self.now = 0
        self.next = np.array([self.next_use(key) for key in self.keys], float)  # [L·E] next_use, while none passed
        self.kept_at = 0  # the time `next` was last moved on at

    def on_route(self, route) -> None:
        super().on_route(route)
        self.now = (route.step - 1) * self.ctx.num_layers + self.position[route.layer]  # replay steps count from 1

    def next_use(self, key: ExpertKey) -> float:
        times = self.uses.get(key, ())
        i = bisect.bisect_right(times, self.now)
        return times[i] if i < len(times) else NEVER

    def priority(self, key: ExpertKey) -> float:
        return -self.next_use(key)

    def priorities(self) -> np.ndarray:
        if self.now < self.kept_at:  # time went back (a replay begun again): every expert's again
            self.next = np.array([self.next_use(key) for key in self.keys], float)
        for i in np.flatnonzero(self.next <= self.now):  # used since: their next use after now
            self.next[i] = self.next_use(self.keys[i])
        self.kept_at = self.now
        return -self.next.reshape(len(self.ctx.layers), self.ctx.num_experts)
