"""A ScoredPolicy whose priorities are arrays over every (layer, expert), so choosing a victim sorts the residents
in NumPy instead of scoring each in Python: the same victim as ScoredPolicy's scan — lowest priority, then least
recently used, then key order — tie for tie (tests/cache/test_array_victim.py holds each subclass to the scan)."""

from __future__ import annotations

from collections.abc import Collection, Container

import numpy as np

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.scored import ScoredPolicy


class ArrayScoredPolicy(ScoredPolicy):
    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        shape = (len(ctx.layers), ctx.num_experts)  # [L, E], rows in execution order
        self.row = {layer: i for i, layer in enumerate(ctx.layers)}
        self.keys = [ExpertKey(layer, e) for layer in ctx.layers for e in range(ctx.num_experts)]  # [L·E]
        by_key = {key: i for i, key in enumerate(sorted(self.keys))}
        self.key_rank = np.array([by_key[key] for key in self.keys])  # [L·E] ties' last word: key order
        self.used_at = np.zeros(shape, dtype=np.int64)  # [L, E] last_use as an array (0: never)
        self.held = np.zeros(shape, dtype=bool)  # [L, E] resident
        self.rows = np.arange(len(ctx.layers))  # [L]

    def distances_from(self, layer: int) -> np.ndarray:
        """[L] layers from `layer` until each row's layer runs again, in execution order (0: `layer` itself)."""
        return (self.rows - self.position[layer]) % self.ctx.num_layers

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        super().on_access(key, precision, step)
        self.used_at[self.row[key.layer], key.expert] = self.clock

    def on_insert(self, key: ExpertKey) -> None:
        super().on_insert(key)
        self.held[self.row[key.layer], key.expert] = True

    def on_evict(self, key: ExpertKey) -> None:
        super().on_evict(key)
        self.held[self.row[key.layer], key.expert] = False

    def priorities(self) -> np.ndarray:
        """[L, E] `priority` of every (layer, expert), float for float."""
        raise NotImplementedError

    def victim(self, candidates: Container[ExpertKey]) -> ExpertKey:
        priorities = self.priorities()
        held = np.flatnonzero(self.held)  # [R] the residents, as positions in self.keys
        order = np.lexsort((self.key_rank[held], self.used_at.ravel()[held], priorities.ravel()[held]))
        for i in held[order]:
            if self.keys[i] in candidates:
                return self.keys[i]
        raise LookupError("no evictable expert")

    def victim_among(self, keys: Collection[ExpertKey]) -> ExpertKey:
        """The same choice as `victim(keys)`, sorting only `keys` (residents: a prefetch's few evictable ones)."""
        if not keys:
            raise LookupError("no evictable expert")
        at = np.array([self.row[key.layer] * self.ctx.num_experts + key.expert for key in keys])  # [K] positions
        first = np.lexsort((self.key_rank[at], self.used_at.ravel()[at], self.priorities().ravel()[at]))[0]
        return self.keys[at[first]]
