"""LFU whose counts restart with every sequence: HOBBIT finds per-sequence frequency a better guide than
whole-run frequency, since each request routes to its own experts."""

from __future__ import annotations

import heapq

from moetier.cache.policies.lfu import LFUPolicy


class LFUSeqPolicy(LFUPolicy):
    name = "lfu-seq"

    def on_sequence_start(self) -> None:
        self.counts.clear()
        self._heap = []
        for key in self._resident:  # re-rank the residents at count 0, oldest use first
            heapq.heappush(self._heap, (0, self._last[key], key))
