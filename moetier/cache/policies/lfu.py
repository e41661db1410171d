"""Least frequently used over the whole run (counts survive eviction), ties broken by least recent use.

A heap of (count, last_use, key) with lazy invalidation keeps `victim` logarithmic instead of a scan."""

from __future__ import annotations

import heapq
from collections.abc import Container

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.base import EvictionPolicy


class LFUPolicy(EvictionPolicy):
    name = "lfu"

    def __init__(self) -> None:
        self.counts: dict[ExpertKey, int] = {}
        self._last: dict[ExpertKey, int] = {}
        self._resident: set[ExpertKey] = set()
        self._heap: list[tuple[int, int, ExpertKey]] = []
        self._tick = 0

    def _push(self, key: ExpertKey) -> None:
        self._tick += 1
        self._last[key] = self._tick
        heapq.heappush(self._heap, (self.counts.get(key, 0), self._tick, key))
        if len(self._heap) > 4 * len(self._resident) + 64:  # drop stale entries now and then
            self._heap = [e for e in self._heap if self._current(e)]
            heapq.heapify(self._heap)

    def on_insert(self, key: ExpertKey) -> None:
        self._resident.add(key)
        self._push(key)

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1
        if key in self._resident:
            self._push(key)

    def on_evict(self, key: ExpertKey) -> None:
        self._resident.discard(key)

    def _current(self, entry: tuple[int, int, ExpertKey]) -> bool:
        count, tick, key = entry
        return key in self._resident and self._last.get(key) == tick and self.counts.get(key, 0) == count

    def victim(self, candidates: Container[ExpertKey]) -> ExpertKey:
        skipped = []
        try:
            while self._heap:
                entry = heapq.heappop(self._heap)
                if not self._current(entry):
                    continue  # stale: the key was used or evicted since
                skipped.append(entry)
                if entry[2] in candidates:
                    return entry[2]
            raise LookupError("no evictable expert")
        finally:
            for entry in skipped:  # pinned keys and the victim stay; on_evict drops the victim lazily
                heapq.heappush(self._heap, entry)
