"""ARC (Megiddo & Modha, FAST 2003), one of the adaptive baselines FlashMoE compares against.

T1 holds experts used once since they came in, T2 those used again; ghost lists B1 and B2 remember what
each recently lost. A miss on a B1 ghost means T1 was too small: its target size p grows; a miss on a B2
ghost shrinks it. Eviction takes T1's least recent when T1 exceeds p, else T2's.

Fitting the contract: misses are seen in `on_route` (the layer's needed experts that are not resident) and
adapt p there, before the evictions they cause; an expert's first access after its load is the use that
loaded it, not a second use."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.base import EvictionPolicy
from moetier.cache.policies.context import PolicyContext


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, ctx: PolicyContext) -> None:
        self.c = ctx.num_slots
        self.p = 0.0
        self.t1: OrderedDict[ExpertKey, None] = OrderedDict()  # least recent first
        self.t2: OrderedDict[ExpertKey, None] = OrderedDict()
        self.b1: OrderedDict[ExpertKey, None] = OrderedDict()
        self.b2: OrderedDict[ExpertKey, None] = OrderedDict()
        self._fresh: set[ExpertKey] = set()  # loaded, not yet used
        self._miss_from_b2 = False

    def on_route(self, route) -> None:
        self._miss_from_b2 = False
        for e in set(route.topk_ids.ravel().tolist()):
            key = ExpertKey(route.layer, e)
            if key in self.t1 or key in self.t2:
                continue
            if key in self.b1:
                self.p = min(self.c, self.p + max(len(self.b2) / len(self.b1), 1.0))
            elif key in self.b2:
                self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
                self._miss_from_b2 = True

    def on_insert(self, key: ExpertKey) -> None:
        ghost = key in self.b1 or key in self.b2  # seen recently: it goes straight to T2
        self.b1.pop(key, None)
        self.b2.pop(key, None)
        (self.t2 if ghost else self.t1)[key] = None
        self._fresh.add(key)

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        if key in self._fresh:
            self._fresh.discard(key)
            return
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def on_evict(self, key: ExpertKey) -> None:
        self._fresh.discard(key)
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None
        while self.b1 and len(self.t1) + len(self.b1) > self.c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.c:
            self.b2.popitem(last=False)

    def victim(self, candidates: Container[ExpertKey]) -> ExpertKey:
        from_t1 = self.t1 and (len(self.t1) > self.p or (self._miss_from_b2 and len(self.t1) == int(self.p)))
        for order in ((self.t1, self.t2) if from_t1 else (self.t2, self.t1)):
            for key in order:  # least recent first; pinned keys skipped
                if key in candidates:
                    return key
        raise LookupError("no evictable expert")
