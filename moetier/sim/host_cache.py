"""The host-memory tier behind a GPU's expert cache as the simulator keeps it — moetier/engine/host_tier.py's
bookkeeping without the memory: per precision a number of host slots, least recently used out. A pool with a slot
for every expert is filled before the first step (as the engine fills a whole pool at start-up); a smaller one fills
on demand. A load found here is one copy over the link; one not found is a read from the disk into it, then the
copy (SimExecutor prices both, each on its own resource)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from moetier.cache.keys import ExpertKey


class HostCache:
    def __init__(self, slots: Mapping[str, int], keys: Iterable[ExpertKey]) -> None:
        """`slots`: host slots per precision (at least 1); `keys`: every expert, filling a pool that holds them all."""
        keys = [ExpertKey(*k) for k in keys]
        self.slots = dict(slots)
        for precision, n in self.slots.items():
            if n < 1:
                raise ValueError(f"the host tier needs at least one {precision} slot, not {n}")
        self._lru: dict[str, OrderedDict[ExpertKey, None]] = {
            p: OrderedDict.fromkeys(keys) if n >= len(keys) else OrderedDict() for p, n in self.slots.items()}
        self.hits = self.reads = 0

    def _pool(self, precision: str) -> OrderedDict[ExpertKey, None]:
        pool = self._lru.get(precision)
        if pool is None:
            raise ValueError(f"the host tier has no {precision} slots (it has {', '.join(self.slots)})")
        return pool

    def __contains__(self, item: tuple[ExpertKey, str]) -> bool:
        key, precision = item
        return key in self._pool(precision)

    def lookup(self, key: ExpertKey, precision: str) -> bool:
        """Whether `key` at `precision` is in host memory (now the most recently used), counted as a hit."""
        lru = self._pool(precision)
        if key not in lru:
            return False
        lru.move_to_end(key)
        self.hits += 1
        return True

    def admit(self, key: ExpertKey, precision: str) -> None:
        """`key` read from disk into a slot: a free one, or the least recently used one's."""
        lru = self._pool(precision)
        if len(lru) >= self.slots[precision]:
            lru.popitem(last=False)
        lru[key] = None
        self.reads += 1
