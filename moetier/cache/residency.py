"""Which expert sits in which cache slot, and which are pinned. Pure logic shared by the real engine and the
simulator: given the same calls, both make the same evictions, so their hits and misses agree."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.base import EvictionPolicy


class _Evictable:
    """`in` view of the resident, unpinned keys (of one layer, with per-layer capacity), handed to the policy
    without building a list."""

    def __init__(self, residency: Residency, layer: int | None = None) -> None:
        self._r = residency
        self.layer = layer

    def __contains__(self, key: object) -> bool:
        return (key in self._r.slot_of and key not in self._r.pinned
                and (self.layer is None or key.layer == self.layer))


class Residency:
    """`layers`: split the slots evenly among these layers, each evicting only its own experts (as some papers
    partition the cache); None: one cache shared by all layers."""

    def __init__(self, num_slots: int, policy: EvictionPolicy, layers: Sequence[int] | None = None) -> None:
        if num_slots < 1:
            raise ValueError("the expert cache needs at least one slot")
        self.num_slots = num_slots
        self.policy = policy
        self.slot_of: dict[ExpertKey, int] = {}
        self.key_of: list[ExpertKey | None] = [None] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.pinned: set[ExpertKey] = set()
        self._evictable = _Evictable(self)
        self.layer_capacity = num_slots // len(layers) if layers else None
        if self.layer_capacity == 0:
            raise ValueError(f"{num_slots} slots cannot be split among {len(layers)} layers")
        self._layer_count = dict.fromkeys(layers, 0) if layers else {}
        self._layer_evictable = {layer: _Evictable(self, layer) for layer in layers or ()}

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def has_room(self, layer: int) -> bool:
        """A free slot `layer` may take without evicting."""
        if self.layer_capacity is None:
            return bool(self._free)
        return bool(self._free) and self._layer_count[layer] < self.layer_capacity

    def pin(self, key: ExpertKey) -> None:
        self.pinned.add(key)

    def unpin_all(self) -> None:
        self.pinned.clear()

    def admit(self, key: ExpertKey) -> tuple[int, ExpertKey | None] | None:
        """A slot for `key` (pinned on return): a free one, else the policy's victim among the evictable keys.
        Returns (slot, evicted key or None), or None if every resident key is pinned."""
        if self.has_room(key.layer):
            slot, evicted = self._free.pop(), None
        elif self.layer_capacity is None and len(self.slot_of) > len(self.pinned):
            evicted = self.policy.victim(self._evictable)
            slot = self._evict(evicted)
        elif self.layer_capacity is not None and self._layer_count[key.layer] > self._pinned_in(key.layer):
            evicted = self.policy.victim(self._layer_evictable[key.layer])
            slot = self._evict(evicted)
        else:
            return None
        self._insert(key, slot)
        return slot, evicted

    def replace(self, key: ExpertKey, candidates: Collection[ExpertKey]) -> tuple[int, ExpertKey]:
        """Put `key` in the slot of one of `candidates` (pinned keys the caller will have finished with before
        the slot is overwritten), chosen by the policy."""
        evicted = self.policy.victim(candidates)
        if evicted not in candidates:
            raise RuntimeError(f"policy {self.policy.name} chose {evicted}, which is not a candidate")
        self.pinned.discard(evicted)
        slot = self._evict(evicted)
        self._insert(key, slot)
        return slot, evicted

    def drop(self, key: ExpertKey) -> None:
        """Forget `key` (its slot's contents are not to be trusted, e.g. after a failed read)."""
        if key in self.slot_of:
            self.pinned.discard(key)
            self._free.append(self._evict(key))

    def _pinned_in(self, layer: int) -> int:
        return sum(1 for k in self.pinned if k.layer == layer)  # the pinned keys: one layer's experts at most

    def _evict(self, key: ExpertKey) -> int:
        slot = self.slot_of.pop(key)
        self.key_of[slot] = None
        if self.layer_capacity is not None:
            self._layer_count[key.layer] -= 1
        self.policy.on_evict(key)
        return slot

    def _insert(self, key: ExpertKey, slot: int) -> None:
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self.pinned.add(key)
        if self.layer_capacity is not None:
            self._layer_count[key.layer] += 1
        self.policy.on_insert(key)
