"""Least recently used: evict the resident expert whose last use is oldest."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()  # oldest first

    def on_insert(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_evict(self, key: ExpertKey) -> None:
        self._order.pop(key, None)

    def victim(self, candidates: Container[ExpertKey]) -> ExpertKey:
        for key in self._order:  # stops at the first evictable key; only pinned keys are skipped
            if key in candidates:
                return key
        raise LookupError("no evictable expert")
