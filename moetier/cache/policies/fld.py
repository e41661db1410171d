"""Farthest layer distance (HOBBIT §3.4, Eq. 3's l term): evict the expert whose layer runs last counted from
l_i, the layer of the expert the cache is making room for — the layer being computed for an on-demand load, a later
one for a prefetch (`on_admit`) — so the layer just before l_i is the one needed latest. Ties go to the least
recently used. Chosen from arrays (ArrayScoredPolicy): a victim is a sort of the residents, not a scan."""

from __future__ import annotations

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.arrayed import ArrayScoredPolicy


class FLDPolicy(ArrayScoredPolicy):
    name = "fld"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.inserting = ctx.layers[0]  # l_i

    def on_route(self, route) -> None:
        super().on_route(route)
        self.inserting = route.layer

    def on_admit(self, key: ExpertKey) -> None:
        self.inserting = key.layer

    def priority(self, key: ExpertKey) -> float:
        return -((self.position[key.layer] - self.position[self.inserting]) % self.ctx.num_layers)

    def priorities(self) -> np.ndarray:
        distance = self.distances_from(self.inserting)  # [L]
        return np.repeat(-distance.astype(np.float64), self.ctx.num_experts).reshape(len(self.rows), -1)  # [L, E]
