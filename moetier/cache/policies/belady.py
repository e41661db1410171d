"""Belady's MIN, the offline optimum: evict the expert whose next use is farthest in the future (never used
again counts as farthest). It is handed the future it will face — for each expert, the times of its uses — by
whoever drives it from a trace (the simulator, `cache-bench`), so it is a bound there and never a policy for
live generation. Time is the position of a layer step: (step - 1) * layers + the layer's execution position."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.scored import ScoredPolicy
from moetier.errors import MoetierError

NEVER = float("inf")


class BeladyPolicy(ScoredPolicy):
    name = "belady"

    def __init__(self, ctx: PolicyContext, future: Mapping[ExpertKey, Sequence[int]] | None = None) -> None:
        """`future`: for each expert, the ascending times of its uses."""
        super().__init__(ctx)
        if future is None:
            raise MoetierError("belady is the offline optimum: it needs the future it will face",
                               hint="use it in `moetier sim` or `moetier cache-bench`, not in live generation")
        self.uses = future
        self.now = 0

    def on_route(self, route) -> None:
        super().on_route(route)
        self.now = (route.step - 1) * self.ctx.num_layers + self.position[route.layer]  # replay steps count from 1

    def next_use(self, key: ExpertKey) -> float:
        times = self.uses.get(key, ())
        i = bisect.bisect_right(times, self.now)
        return times[i] if i < len(times) else NEVER

    def priority(self, key: ExpertKey) -> float:
        return -self.next_use(key)
