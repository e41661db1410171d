"""Belady's MIN, the offline optimum: evict the expert whose next use is farthest in the future (never used
again counts as farthest). Built from the very trace it will replay, so it is a bound for the simulator and
`cache-bench`, never a policy for live generation. Time is the position of a layer step in the replay: step by
step, layer by layer in execution order, as the replay visits them."""

from __future__ import annotations

import bisect

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.scored import ScoredPolicy
from moetier.errors import MoetierError

NEVER = float("inf")


class BeladyPolicy(ScoredPolicy):
    name = "belady"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        if ctx.trace is None:
            raise MoetierError("belady is the offline optimum: it needs the trace it will replay",
                               hint="use it in `moetier sim` or `moetier cache-bench`, not in live generation")
        from moetier.sim.replay import steps

        uses: dict[ExpertKey, list[int]] = {}
        trace, num_layers = ctx.trace, ctx.num_layers
        for index, (_, rows) in enumerate(steps(trace)):
            for j, layer in enumerate(trace.layers):
                for e in np.unique(trace.topk_ids[rows, j]).tolist():
                    uses.setdefault(ExpertKey(layer, e), []).append(index * num_layers + self.position[layer])
        self.uses = uses
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
