"""Which experts are in the fast tier, at which precision, in which slot, and which may not be evicted. Pure logic
shared by the real and the simulated executor: given the same calls, both make the same evictions, so their hits
and misses agree.

Capacity is in bytes; an entry takes its precision's bytes and a slot of that precision's pool. An entry is
loading from its admission until its executor reports the read landed: a key being loaded is neither resident
(it cannot be computed from yet) nor free (its bytes are taken, and a running read is never interrupted, so it
cannot be evicted). A pin keeps an entry from eviction and says why: in use by the layer being computed, or
prefetched and not yet used. Capacity can change between steps: shrinking evicts by policy, growing adds free
bytes."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.base import EvictionPolicy

IN_USE, PREFETCHED = "in-use", "prefetched"  # why an entry is pinned


@dataclass
class Entry:
    precision: Precision
    nbytes: int
    slot: int  # in its precision's pool
    loading: bool = True
    pin: str | None = IN_USE

    @property
    def held(self) -> bool:
        """Not evictable: a read in flight, or pinned."""
        return self.loading or self.pin is not None


class _Evictable:
    """`in` view of the evictable keys (of one layer, with a per-layer split), handed to the policy without
    building a list."""

    def __init__(self, residency: Residency, layer: int | None = None) -> None:
        self._r = residency
        self.layer = layer

    def __contains__(self, key: object) -> bool:
        entry = self._r.entries.get(key)
        return entry is not None and not entry.held and (self.layer is None or key.layer == self.layer)


class _Sparing:
    """An evictable view less the keys `spare` names."""

    def __init__(self, view: _Evictable, spare: Callable[[ExpertKey], bool]) -> None:
        self.view, self.spare = view, spare

    def __contains__(self, key: object) -> bool:
        return key in self.view and not self.spare(key)


class Residency:
    """`entry_bytes`: bytes of one expert at each precision the cache may hold. `layers`: split the capacity
    evenly among these layers, each evicting only its own experts (as some papers partition the cache); None:
    one cache shared by all layers."""

    def __init__(self, capacity_bytes: int, entry_bytes: Mapping[Precision, int], policy: EvictionPolicy,
                 layers: Sequence[int] | None = None) -> None:
        self.entry_bytes = dict(entry_bytes)
        self.policy = policy
        self.layers = tuple(layers) if layers else None
        self.entries: dict[ExpertKey, Entry] = {}
        self.used_bytes = 0
        self._held_bytes = 0  # of entries loading or pinned
        self._layer_used = dict.fromkeys(self.layers or (), 0)
        self._layer_held = dict.fromkeys(self.layers or (), 0)
        self._free_slots: dict[Precision, list[int]] = {p: [] for p in self.entry_bytes}
        self._minted = dict.fromkeys(self.entry_bytes, 0)  # slots of each precision handed out so far
        self._pinned: dict[str, set[ExpertKey]] = {IN_USE: set(), PREFETCHED: set()}
        self._evictable = _Evictable(self)
        self._layer_evictable = {layer: _Evictable(self, layer) for layer in self.layers or ()}
        self.capacity_bytes = 0
        self.resize(capacity_bytes)

    # -- what is there -----------------------------------------------------------------------------------------

    def __contains__(self, key: ExpertKey) -> bool:
        """Resident: its weights are in the fast tier and can be computed from."""
        entry = self.entries.get(key)
        return entry is not None and not entry.loading

    def __len__(self) -> int:
        return len(self.entries)

    def loading(self, key: ExpertKey) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.loading

    @property
    def layer_capacity(self) -> int | None:
        return self.capacity_bytes // len(self.layers) if self.layers else None

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def slots(self, precision: Precision) -> int:
        """Entries of `precision` the capacity holds: the size its slot pool needs."""
        return self.capacity_bytes // self.entry_bytes[precision]

    def has_room(self, layer: int, nbytes: int) -> bool:
        """`nbytes` free for `layer` without evicting."""
        if self.used_bytes + nbytes > self.capacity_bytes:
            return False
        return self.layers is None or self._layer_used[layer] + nbytes <= self.layer_capacity

    # -- admitting and evicting --------------------------------------------------------------------------------

    def admit(self, key: ExpertKey, precision: Precision, pin: str = IN_USE,
              spare: Callable[[ExpertKey], bool] | None = None) -> tuple[int, tuple[ExpertKey, ...]] | None:
        """Room for `key` at `precision`, its read about to start (loading, pinned for `pin`): free bytes, else
        the policy's victims among the evictable entries (less those `spare` names). Returns (slot, evicted
        keys), or None if evicting everything evictable would not make room (nothing is evicted then) or the
        spared keys are all there is to evict (what was evicted before that stays free)."""
        nbytes = self.entry_bytes[precision]
        if not self._can_make_room(key.layer, nbytes):
            return None
        evicted = []
        view = self._layer_evictable[key.layer] if self.layers else self._evictable
        if spare is not None:
            view = _Sparing(view, spare)
        while not self.has_room(key.layer, nbytes):
            try:
                victim = self.policy.victim(view)
            except LookupError:
                if spare is None:
                    raise
                return None
            self._evict(victim)
            evicted.append(victim)
        return self._insert(key, precision, pin), tuple(evicted)

    def replace(self, key: ExpertKey, precision: Precision, candidates: Collection[ExpertKey]) -> tuple[int, ExpertKey]:
        """Put `key` in the slot of one of `candidates` — pinned entries of the same precision that the caller
        will have finished with before the slot is overwritten — chosen by the policy. How a layer needing more
        experts than the cache holds streams them through it."""
        victim = self.policy.victim(candidates)
        if victim not in candidates:
            raise RuntimeError(f"policy {self.policy.name} chose {victim}, which is not a candidate")
        if self.entries[victim].precision != precision:
            raise RuntimeError(f"{victim} is held at {self.entries[victim].precision}, not {precision}")
        slot = self.entries[victim].slot
        self._release_pin(victim)
        self._evict(victim, free_slot=False)
        self._insert(key, precision, IN_USE, slot)
        return slot, victim

    def admit_while_room(self, keys: Iterable[ExpertKey], precision: Precision) -> list[tuple[ExpertKey, int]]:
        """Admit `keys` in order without evicting anything, while the cache has room (a per-layer split skips
        a layer whose share is full): a warm start. Returns (key, slot) of each admitted key, loading."""
        nbytes, admitted = self.entry_bytes[precision], []
        for key in keys:
            if self.used_bytes + nbytes > self.capacity_bytes:
                break
            if key not in self.entries and self.has_room(key.layer, nbytes):
                admitted.append((key, self._insert(key, precision, IN_USE)))
        return admitted

    def landed(self, key: ExpertKey) -> None:
        """The read of `key` finished: it is resident."""
        entry = self.entries[key]
        if entry.loading:
            entry.loading = False
            if entry.pin is None:
                self._unhold(key, entry)

    def drop(self, key: ExpertKey) -> None:
        """Forget `key` (its slot's contents are not to be trusted, e.g. after a failed read)."""
        if key in self.entries:
            self._release_pin(key)
            self._evict(key)

    def resize(self, capacity_bytes: int) -> list[ExpertKey]:
        """Change the capacity between steps. Shrinking evicts by policy until the entries fit (a per-layer split
        shrinks each layer's share); growing adds free bytes. Returns what was evicted."""
        if capacity_bytes < 0:
            raise ValueError("capacity must not be negative")
        old, self.capacity_bytes = self.capacity_bytes, capacity_bytes
        evicted = []
        scopes = [(layer, self._layer_evictable[layer]) for layer in self.layers] if self.layers else [
            (None, self._evictable)]
        for layer, view in scopes:
            while self._over(layer):
                if self._evictable_bytes(layer) == 0:
                    self.capacity_bytes = old
                    raise ValueError(f"cannot shrink the cache to {capacity_bytes} bytes: "
                                     f"{self._held_bytes} bytes are pinned or being read")
                victim = self.policy.victim(view)
                self._evict(victim)
                evicted.append(victim)
        return evicted

    # -- pins --------------------------------------------------------------------------------------------------

    def pin(self, key: ExpertKey, reason: str = IN_USE) -> None:
        entry = self.entries[key]
        if entry.pin == reason:
            return
        if entry.pin is not None:
            self._pinned[entry.pin].discard(key)
        elif not entry.loading:
            self._hold(key, entry)
        entry.pin = reason
        self._pinned[reason].add(key)

    def unpin(self, key: ExpertKey, reason: str) -> None:
        """Release `key`'s pin if it is pinned for `reason`."""
        entry = self.entries.get(key)
        if entry is not None and entry.pin == reason:
            self._release_pin(key)

    def pinned_bytes(self, reason: str, layer: int | None = None) -> int:
        """Bytes of the entries pinned for `reason` (of `layer` only, if given)."""
        return sum(self.entries[k].nbytes for k in self._pinned[reason] if layer is None or k.layer == layer)

    def unpin_all(self, reason: str = IN_USE) -> None:
        """Release every pin for `reason` (by default the layer's in-use pins, when it is done)."""
        for key in self._pinned[reason]:
            entry = self.entries[key]
            entry.pin = None
            if not entry.loading:
                self._unhold(key, entry)
        self._pinned[reason].clear()

    def pinned(self, reason: str = IN_USE) -> frozenset[ExpertKey]:
        return frozenset(self._pinned[reason])

    # -- bookkeeping -------------------------------------------------------------------------------------------

    def _over(self, layer: int | None) -> bool:
        if layer is None:
            return self.used_bytes > self.capacity_bytes
        return self._layer_used[layer] > self.layer_capacity

    def _evictable_bytes(self, layer: int | None) -> int:
        if layer is None:
            return self.used_bytes - self._held_bytes
        return self._layer_used[layer] - self._layer_held[layer]

    def _can_make_room(self, layer: int, nbytes: int) -> bool:
        if nbytes > self.capacity_bytes - self._held_bytes:
            return False
        if self.layers is None:
            return True
        return nbytes <= self.layer_capacity - self._layer_held[layer]

    def _insert(self, key: ExpertKey, precision: Precision, pin: str, slot: int | None = None) -> int:
        if slot is None:
            free = self._free_slots[precision]
            if free:
                slot = free.pop()
            else:
                slot = self._minted[precision]
                self._minted[precision] += 1
        entry = Entry(precision, self.entry_bytes[precision], slot, loading=True, pin=pin)
        self.entries[key] = entry
        self._pinned[pin].add(key)
        self.used_bytes += entry.nbytes
        if self.layers:
            self._layer_used[key.layer] += entry.nbytes
        self._hold(key, entry)
        self.policy.on_insert(key)
        return slot

    def _evict(self, key: ExpertKey, free_slot: bool = True) -> None:
        entry = self.entries.pop(key)
        if entry.held:  # only drop() and replace() evict a held entry, after releasing its pin
            self._unhold(key, entry)
        self.used_bytes -= entry.nbytes
        if self.layers:
            self._layer_used[key.layer] -= entry.nbytes
        if free_slot:
            self._free_slots[entry.precision].append(entry.slot)
        self.policy.on_evict(key)

    def _release_pin(self, key: ExpertKey) -> None:
        entry = self.entries[key]
        if entry.pin is not None:
            self._pinned[entry.pin].discard(key)
            entry.pin = None
            if not entry.loading:
                self._unhold(key, entry)

    def _hold(self, key: ExpertKey, entry: Entry) -> None:
        self._held_bytes += entry.nbytes
        if self.layers:
            self._layer_held[key.layer] += entry.nbytes

    def _unhold(self, key: ExpertKey, entry: Entry) -> None:
        self._held_bytes -= entry.nbytes
        if self.layers:
            self._layer_held[key.layer] -= entry.nbytes
