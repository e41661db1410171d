"""Farthest layer distance (HOBBIT): evict the expert whose layer runs last from here in the forward pass —
the layer just computed is the one needed latest. Ties go to the least recently used."""

from __future__ import annotations

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.scored import ScoredPolicy


class FLDPolicy(ScoredPolicy):
    name = "fld"

    def priority(self, key: ExpertKey) -> float:
        return -self.layer_distance(key)
