"""A base for policies whose keep-priority of every expert moves with every step (recency, windows of gate
scores, learned predictions): the victim is the evictable resident expert of lowest priority, ties going to
the least recently used. That is a scan over the residents at each eviction; no ordering survives between
evictions for these policies, and a few hundred residents cost far less than the read the eviction makes
room for."""

from __future__ import annotations

from collections.abc import Container

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.base import EvictionPolicy
from moetier.cache.policies.context import PolicyContext


class ScoredPolicy(EvictionPolicy):
    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.position = {layer: i for i, layer in enumerate(ctx.layers)}  # layer -> execution order
        self.resident: set[ExpertKey] = set()
        self.last_use: dict[ExpertKey, int] = {}
        self.clock = 0  # accesses so far
        self.layer = ctx.layers[0]  # the layer being computed
        self.step = 0

    def on_route(self, route) -> None:
        self.layer, self.step = route.layer, route.step

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        self.clock += 1
        self.last_use[key] = self.clock

    def on_insert(self, key: ExpertKey) -> None:
        self.resident.add(key)

    def on_evict(self, key: ExpertKey) -> None:
        self.resident.discard(key)

    def priority(self, key: ExpertKey) -> float:
        """How much keeping `key` is worth; the lowest is evicted."""
        raise NotImplementedError

    def victim(self, candidates: Container[ExpertKey]) -> ExpertKey:
        best, best_rank = None, None
        for key in self.resident:
            if key in candidates:
                rank = (self.priority(key), self.last_use.get(key, 0), key)
                if best_rank is None or rank < best_rank:
                    best, best_rank = key, rank
        if best is None:
            raise LookupError("no evictable expert")
        return best
