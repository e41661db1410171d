"""Least recently used: evict the resident expert whose last use is oldest."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container, Hashable

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()  # oldest first
        self._stamp: dict[ExpertKey, int] = {}  # the same order as numbers: each key's last insert or access
        self._clock = 0
        # a split cache's: each key's part, and each part's keys in the same order (a part's victim found at the
        # head of its own order, not behind the other parts' older keys: `victim_in`)
        self._part: dict[ExpertKey, Hashable] = {}
        self._part_order: dict[Hashable, OrderedDict[ExpertKey, None]] = {}

    def _touch(self, key: ExpertKey) -> None:
        self._order.move_to_end(key)
        self._clock += 1
        self._stamp[key] = self._clock
        part = self._part.get(key)
        if part is not None:
            self._part_order[part].move_to_end(key)

    def on_part(self, key: ExpertKey, part: Hashable) -> None:
        self._drop_part(key)  # (a key whose insert never followed: it goes where it is told now)
        self._part[key] = part
        self._part_order.setdefault(part, OrderedDict())[key] = None

    def _drop_part(self, key: ExpertKey) -> None:
        part = self._part.pop(key, None)
        if part is not None:
            self._part_order[part].pop(key, None)

    def on_insert(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._touch(key)

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        if key in self._order:
            self._touch(key)

    def on_evict(self, key: ExpertKey) -> None:
        self._order.pop(key, None)
        self._stamp.pop(key, None)
        self._drop_part(key)

    def victim_in(self, part: Hashable, keys: Collection[ExpertKey]) -> ExpertKey:
        """The oldest of `keys`, all of `part`: the walk of that part's own order up to the first of them (HOBBIT's
        high sub-cache's oldest sat behind ~96 of the low one's in the whole order, walked a victim)."""
        order = self._part_order.get(part)
        if order is None or not keys:
            return self.victim_among(keys)
        keys = keys if isinstance(keys, (set, frozenset)) else set(keys)
        for key in order:
            if key in keys:
                return key
        return self.victim_among(keys)  # (keys not of this part, against the contract: the whole order's answer)

    def victim_among(self, keys: Collection[ExpertKey]) -> ExpertKey:
        """The oldest of `keys`: what `victim` finds walking the order. A few of many (a prefetch's listed keys): the
        least stamp, O(len(keys)); a larger share (a split cache's part: HOBBIT's high part, ~100 keys a victim, where
        the stamps' min took a tenth of a HOBBIT layer's host time): the walk up to the first of them, each step a
        set's lookup, O(the keys older than it)."""
        if not keys:
            raise LookupError("no evictable expert")
        if 4 * len(keys) < len(self._order):
            return min(keys, key=self._stamp.__getitem__)
        keys = keys if isinstance(keys, (set, frozenset)) else set(keys)
        for key in self._order:
            if key in keys:
                return key
        raise LookupError("no evictable expert")

    def victim(self, candidates: Container[ExpertKey]) -> ExpertKey:
        for key in self._order:  # stops at the first evictable key; only pinned keys are skipped
            if key in candidates:
                return key
        raise LookupError("no evictable expert")
