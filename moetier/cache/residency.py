"""Which experts are in the fast tier, at which precision, in which slot, and which may not be evicted. Pure logic
shared by the real and the simulated executor: given the same calls, both make the same evictions, so their hits
and misses agree.

Capacity is in bytes; an entry takes its precision's bytes and a slot of that precision's pool. An entry is
loading from its admission until its executor reports the read landed: a key being loaded is neither resident
(it cannot be computed from yet) nor free (its bytes are taken, and a running read is never interrupted, so it
cannot be evicted). A pin keeps an entry from eviction and says why: in use by the layer being computed, or
prefetched and not yet used. Capacity can change between steps: shrinking evicts by policy, growing adds free
bytes.

The capacity is one whole, or split into parts that each evict only their own entries: per layer (as some papers
partition the cache), or per precision (HOBBIT's high- and low-precision sub-caches, §3.4, each a share of the
bytes)."""

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
    kept: bool = False  # resident for good (Residency.keep)

    @property
    def held(self) -> bool:
        """Not evictable: a read in flight, pinned, or kept."""
        return self.loading or self.pin is not None or self.kept


class _Evictable:
    """`in` view of the evictable keys (of one part, with a split), handed to the policy without building a
    list."""

    def __init__(self, residency: Residency, part=None) -> None:
        self._r = residency
        self.part = part

    def __contains__(self, key: object) -> bool:
        entry = self._r.entries.get(key)
        return (entry is not None and not entry.held
                and (self.part is None or self._r.part_of(key, entry.precision) == self.part))


class _Sparing:
    """An evictable view less the keys `spare` names."""

    def __init__(self, view: _Evictable, spare: Callable[[ExpertKey], bool]) -> None:
        self.view, self.spare = view, spare

    def __contains__(self, key: object) -> bool:
        return key in self.view and not self.spare(key)


class Residency:
    """`entry_bytes`: bytes of one expert at each precision the cache may hold. `layers`: split the capacity
    evenly among these layers, each evicting only its own experts; `shares`: split it among precisions by these
    shares of the bytes (HOBBIT's sub-caches; the precisions not named get no room). Neither: one cache shared by
    all layers and precisions."""

    def __init__(self, capacity_bytes: int, entry_bytes: Mapping[Precision, int], policy: EvictionPolicy,
                 layers: Sequence[int] | None = None, shares: Mapping[Precision, float] | None = None) -> None:
        self.entry_bytes = dict(entry_bytes)
        self.policy = policy
        self.layers = tuple(layers) if layers else None
        self.shares = dict(shares) if shares else None
        if self.layers and self.shares:
            raise ValueError("a cache splits by layer or by precision, not both")
        if self.shares and (any(v < 0 for v in self.shares.values()) or sum(self.shares.values()) > 1 + 1e-9
                            or set(self.shares) - set(self.entry_bytes)):
            raise ValueError(f"precision shares must be non-negative, of known precisions, summing to at most 1: "
                             f"{self.shares}")
        self.parts = self.layers or tuple(self.shares or ())  # the keys of a split; () when whole
        self.entries: dict[ExpertKey, Entry] = {}
        self.used_bytes = 0
        self._held_bytes = 0  # of entries loading or pinned
        self._held_count = 0  # (the entries themselves)
        self._part_used = dict.fromkeys(self.parts, 0)
        self._part_held = dict.fromkeys(self.parts, 0)
        self._free_slots: dict[Precision, list[int]] = {p: [] for p in self.entry_bytes}
        self._minted = dict.fromkeys(self.entry_bytes, 0)  # slots of each precision handed out so far
        self._pinned: dict[str, set[ExpertKey]] = {IN_USE: set(), PREFETCHED: set()}
        self._evictable = _Evictable(self)
        self._part_evictable = {part: _Evictable(self, part) for part in self.parts}
        # each part's evictable keys, kept as entries are held and let go: a part's victim is chosen among them
        # (`victim_in`: LRU walks the part's own order) rather than by walking the policy's order over every part's
        # entries — with HOBBIT's sub-caches the high part's oldest entry sat behind ~93 of the low part's (a third
        # of a layer's host time)
        self._part_evictable_keys: dict[object, set[ExpertKey]] = {part: set() for part in self.parts}
        self.capacity_bytes, self._layer_bytes = 0, {}
        self.resize(capacity_bytes)

    # -- what is there -----------------------------------------------------------------------------------------

    def __contains__(self, key: ExpertKey) -> bool:
        """Resident: its weights are in the fast tier and can be computed from."""
        entry = self.entries.get(key)
        return entry is not None and not entry.loading

    @property
    def evictable(self) -> int:
        """How many entries are evictable (neither read nor pinned nor kept)."""
        return len(self.entries) - self._held_count

    def __len__(self) -> int:
        return len(self.entries)

    def loading(self, key: ExpertKey) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.loading

    def part_of(self, key: ExpertKey, precision: Precision):
        """The part of a split `key` at `precision` belongs to (None when the cache is whole)."""
        return key.layer if self.layers else precision if self.shares else None

    def part_capacity(self, part) -> int:
        if part is None:
            return self.capacity_bytes
        if self.layers:
            return self._layer_bytes[part]
        return int(self.capacity_bytes * self.shares[part])

    def _set_capacity(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        if self.layers:
            self._layer_bytes = self._split_by_layer()

    def _split_by_layer(self) -> dict[int, int]:
        """Each layer's bytes: the capacity's whole (largest) entries dealt out evenly, the first layers in execution
        order taking one more each where they do not divide — a share of bytes floored to whole entries a layer left
        up to a slot a layer unused (Mixtral's 32 layers at 14% and 20% of its experts: 1 a layer either way) —
        and what is left below one entry split evenly (room for smaller precisions' entries)."""
        unit = max(self.entry_bytes.values())
        units, extra = divmod(self.capacity_bytes // unit, len(self.layers))
        rest = self.capacity_bytes % unit // len(self.layers)
        return {layer: (units + (i < extra)) * unit + rest for i, layer in enumerate(self.layers)}

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def slots(self, precision: Precision) -> int:
        """Entries of `precision` the capacity holds: the size its slot pool needs."""
        if not self.shares:
            return self.capacity_bytes // self.entry_bytes[precision]
        return self.part_capacity(precision) // self.entry_bytes[precision] if precision in self.shares else 0

    def has_room(self, layer: int, nbytes: int, precision: Precision | None = None) -> bool:
        """`nbytes` free for an expert of `layer` at `precision` without evicting."""
        if self.used_bytes + nbytes > self.capacity_bytes:
            return False
        part = self.part_of(ExpertKey(layer, 0), precision)
        return part is None or self._part_used.get(part, 0) + nbytes <= self.part_capacity(part)

    # -- admitting and evicting --------------------------------------------------------------------------------

    def admit(self, key: ExpertKey, precision: Precision, pin: str = IN_USE,
              spare: Callable[[ExpertKey], bool] | None = None,
              among: set[ExpertKey] | None = None) -> tuple[int, tuple[ExpertKey, ...]] | None:
        """Room for `key` at `precision`, its read about to start (loading, pinned for `pin`): free bytes, else
        the policy's victims among the evictable entries (less those `spare` names). Returns (slot, evicted
        keys), or None if evicting everything evictable would not make room (nothing is evicted then) or the
        spared keys are all there is to evict (what was evicted before that stays free). `among`: with `spare`,
        the caller's set of the keys `spare` leaves (kept up to date here as victims go); when it is a small part
        of the cache the policy picks from it by `victim_among` instead of walking past every spared key — the
        same victim, at a cost of its size (a prefetch at a large batch spares most of the cache)."""
        nbytes = self.entry_bytes[precision]
        part = self.part_of(key, precision)
        if not self._can_make_room(part, nbytes):
            return None
        self.policy.on_admit(key)
        evicted = []
        view = self._evictable if part is None else self._part_evictable[part]
        if spare is not None:
            view = _Sparing(view, spare)
        listed = among is not None and spare is not None and 4 * len(among) < len(self.entries)
        while not self.has_room(key.layer, nbytes, precision):
            try:
                if listed:
                    victim = self.policy.victim_among([k for k in among if k in view])
                elif part is not None:  # (the same victim as the walk: the part's evictable keys are its candidates)
                    keys = self._part_evictable_keys[part]
                    victim = self.policy.victim_in(part, keys if spare is None else [k for k in keys if not spare(k)])
                else:
                    victim = self.policy.victim(view)
            except LookupError:
                if spare is None:
                    raise
                return None
            self._evict(victim)
            evicted.append(victim)
            if among is not None:
                among.discard(victim)
        return self._insert(key, precision, pin), tuple(evicted)

    def replace(self, key: ExpertKey, precision: Precision, candidates: Collection[ExpertKey]) -> tuple[int, ExpertKey]:
        """Put `key` in the slot of one of `candidates` — pinned entries of the same precision that the caller
        will have finished with before the slot is overwritten — chosen by the policy. How a layer needing more
        experts than the cache holds streams them through it."""
        self.policy.on_admit(key)
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
            if key not in self.entries and self.has_room(key.layer, nbytes, precision):
                admitted.append((key, self._insert(key, precision, IN_USE)))
        return admitted

    def landed(self, key: ExpertKey) -> None:
        """The read of `key` finished: it is resident."""
        entry = self.entries[key]
        if entry.loading:
            entry.loading = False
            if entry.pin is None and not entry.kept:
                self._unhold(key, entry)

    def drop(self, key: ExpertKey) -> None:
        """Forget `key` (its slot's contents are not to be trusted, e.g. after a failed read)."""
        if key in self.entries:
            self._release_pin(key)
            self._evict(key)

    def resize(self, capacity_bytes: int, order=None) -> list[ExpertKey]:
        """Change the capacity between steps. Shrinking evicts by policy until the entries fit (a per-layer split
        shrinks each layer's share) — or by `order`, an object whose `ranked(keys)` puts the evictable keys in the order
        they leave, once a shrink (CoMoE's Eq. 18: plan/offload_priority.py); growing adds free bytes. Returns
        what was evicted."""
        if capacity_bytes < 0:
            raise ValueError("capacity must not be negative")
        old = self.capacity_bytes
        self._set_capacity(capacity_bytes)
        evicted = []
        scopes = list(self._part_evictable.items()) or [(None, self._evictable)]
        for part, view in scopes:
            queue = None if order is None else iter(order.ranked([k for k in self.entries if k in view]))
            while self._over(part):
                if self._evictable_bytes(part) == 0:
                    self._set_capacity(old)
                    raise ValueError(f"cannot shrink the cache to {capacity_bytes} bytes: "
                                     f"{self._held_bytes} bytes are pinned, kept or being read")
                victim = self.policy.victim(view) if queue is None else next(queue)
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
        elif not entry.loading and not entry.kept:
            self._hold(key, entry)
        entry.pin = reason
        self._pinned[reason].add(key)

    def keep(self, keys: Iterable[ExpertKey]) -> None:
        """Hold `keys` (cached already) for good: never evicted, never a policy's candidate — an encoder-decoder's
        decoder experts under CoMoE's encoder-focused offloading (`--offload encoder`), so only the encoder's
        come and go."""
        for key in keys:
            entry = self.entries[key]
            if not entry.kept:
                if not entry.held:
                    self._hold(key, entry)
                entry.kept = True

    def unpin(self, key: ExpertKey, reason: str) -> None:
        """Release `key`'s pin if it is pinned for `reason`."""
        entry = self.entries.get(key)
        if entry is not None and entry.pin == reason:
            self._release_pin(key)

    def pinned_bytes(self, reason: str, part=None) -> int:
        """Bytes of the entries pinned for `reason` (of one part of a split only, if given)."""
        return sum(self.entries[k].nbytes for k in self._pinned[reason]
                   if part is None or self.part_of(k, self.entries[k].precision) == part)

    def unpin_all(self, reason: str = IN_USE) -> None:
        """Release every pin for `reason` (by default the layer's in-use pins, when it is done)."""
        for key in self._pinned[reason]:
            entry = self.entries[key]
            entry.pin = None
            if not entry.loading and not entry.kept:
                self._unhold(key, entry)
        self._pinned[reason].clear()

    def pinned(self, reason: str = IN_USE) -> frozenset[ExpertKey]:
        return frozenset(self._pinned[reason])

    # -- bookkeeping -------------------------------------------------------------------------------------------

    def _over(self, part) -> bool:
        if part is None:
            return self.used_bytes > self.capacity_bytes
        return self._part_used[part] > self.part_capacity(part)

    def _evictable_bytes(self, part) -> int:
        if part is None:
            return self.used_bytes - self._held_bytes
        return self._part_used[part] - self._part_held[part]

    def _can_make_room(self, part, nbytes: int) -> bool:
        if nbytes > self.capacity_bytes - self._held_bytes:
            return False
        return part is None or nbytes <= self.part_capacity(part) - self._part_held[part]

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
        if self.parts:
            self.policy.on_part(key, self.part_of(key, precision))
        self._pinned[pin].add(key)
        self.used_bytes += entry.nbytes
        if self.parts:
            self._part_used[self.part_of(key, precision)] += entry.nbytes
        self._hold(key, entry)
        self.policy.on_insert(key)
        return slot

    def _evict(self, key: ExpertKey, free_slot: bool = True) -> None:
        entry = self.entries.pop(key)
        if entry.held:  # only drop() and replace() evict a held entry, after releasing its pin
            self._unhold(key, entry)
        self.used_bytes -= entry.nbytes
        if self.parts:
            part = self.part_of(key, entry.precision)
            self._part_used[part] -= entry.nbytes
            self._part_evictable_keys[part].discard(key)
        if free_slot:
            self._free_slots[entry.precision].append(entry.slot)
        self.policy.on_evict(key)

    def _release_pin(self, key: ExpertKey) -> None:
        entry = self.entries[key]
        if entry.pin is not None:
            self._pinned[entry.pin].discard(key)
            entry.pin = None
            if not entry.loading and not entry.kept:
                self._unhold(key, entry)

    def _hold(self, key: ExpertKey, entry: Entry) -> None:
        self._held_bytes += entry.nbytes
        self._held_count += 1
        if self.parts:
            part = self.part_of(key, entry.precision)
            self._part_held[part] += entry.nbytes
            self._part_evictable_keys[part].discard(key)

    def _unhold(self, key: ExpertKey, entry: Entry) -> None:
        self._held_bytes -= entry.nbytes
        self._held_count -= 1
        if self.parts:
            part = self.part_of(key, entry.precision)
            self._part_held[part] -= entry.nbytes
            self._part_evictable_keys[part].add(key)
