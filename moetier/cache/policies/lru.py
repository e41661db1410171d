"""Least recently used: evict the resident expert whose last use is oldest."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()  # oldest first
        self._stamp: dict[ExpertKey, int] = {}  # the same order as numbers: each key's last insert or access
        self._clock = 0

    def _touch(self, key: ExpertKey) -> None:
        self._order.move_to_end(key)
        self._clock += 1
        self._stamp[key] = self._clock

    def on_insert(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._touch(key)

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        if key in self._order:
            self._touch(key)

    def on_evict(self, key: ExpertKey) -> None:
        self._order.pop(key, None)
        self._stamp.pop(key, None)

    def victim_among(self, keys: Collection[ExpertKey]) -> ExpertKey:
        """The oldest of `keys` by stamp, O(len(keys)): what `victim` finds walking the order."""
        if not keys:
            raise LookupError("no evictable expert")
        return min(keys, key=self._stamp.__getitem__)

    def victim(self, candidates: Container[ExpertKey]) -> ExpertKey:
        for key in self._order:  # stops at the first evictable key; only pinned keys are skipped
            if key in candidates:
                return key
        raise LookupError("no evictable expert")
