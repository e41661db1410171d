"""LeCaR (Vietri et al., HotStorage 2018), FlashMoE's other adaptive baseline: two experts, LRU and LFU, and
a weight on each. An eviction follows one of them drawn by weight; what it evicted goes into that policy's
history. A miss on an expert in a history is that policy's regret: its weight shrinks by exp(-lr * d^t), t the
time since that eviction, d the discount. Draws use a seeded generator, so the engine and the simulator, making
the same calls, make the same draws."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Container

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.base import EvictionPolicy
from moetier.cache.policies.context import PolicyContext


class LeCaRPolicy(EvictionPolicy):
    name = "lecar"

    def __init__(self, ctx: PolicyContext, learning_rate: float = 0.45, seed: int = 0) -> None:
        self.capacity = ctx.num_slots
        self.learning_rate = learning_rate
        self.discount = 0.005 ** (1.0 / ctx.num_slots)
        self.w_lru = 0.5
        self.rng = random.Random(seed)
        self.order: OrderedDict[ExpertKey, None] = OrderedDict()  # resident, least recent first
        self.counts: dict[ExpertKey, int] = {}  # uses while resident
        self.history = {"lru": OrderedDict(), "lfu": OrderedDict()}  # evicted key -> time, oldest first
        self.clock = 0
        self._chooser: str | None = None

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        self.clock += 1
        if key in self.order:
            self.order.move_to_end(key)
            self.counts[key] = self.counts.get(key, 0) + 1

    def on_insert(self, key: ExpertKey) -> None:
        self.order[key] = None
        self.counts[key] = 0
        for name, hist in self.history.items():
            if key in hist:  # a miss the policy `name` caused: penalise it
                regret = self.discount ** (self.clock - hist.pop(key))
                w_lru = self.w_lru * (math.exp(-self.learning_rate * regret) if name == "lru" else 1.0)
                w_lfu = (1 - self.w_lru) * (math.exp(-self.learning_rate * regret) if name == "lfu" else 1.0)
                self.w_lru = w_lru / (w_lru + w_lfu)

    def on_evict(self, key: ExpertKey) -> None:
        self.order.pop(key, None)
        self.counts.pop(key, None)
        if self._chooser is not None:
            hist = self.history[self._chooser]
            hist[key] = self.clock
            if len(hist) > self.capacity:
                hist.popitem(last=False)
            self._chooser = None

    def victim(self, candidates: Container[ExpertKey]) -> ExpertKey:
        evictable = [k for k in self.order if k in candidates]  # least recent first
        if not evictable:
            raise LookupError("no evictable expert")
        self._chooser = "lru" if self.rng.random() < self.w_lru else "lfu"
        if self._chooser == "lru":
            return evictable[0]
        return min(evictable, key=lambda k: self.counts[k])  # min keeps the least recent among equals
