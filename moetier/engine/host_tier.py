"""The host-memory tier behind a GPU's expert cache: experts in page-locked host memory, copied to the device over
PCIe, with the store on disk behind it (HOBBIT's and PreScope's hierarchy: GPU memory, host memory, SSD).

Per precision the run reads, a pool of host slots (HostSlots: one anonymous mapping per segment, O_DIRECT reads
land in place) registered with CUDA as page-locked, so a copy to the device runs at the link's full speed (53-55
GB/s host to device on the H200 machine, against 8-16 GB/s from pageable memory: bench/gpu/micro.py). A pool that
holds every expert of its precision (`whole`) is filled at start-up, each expert at its place among the model's
experts (the slot placement computes from); a smaller one is a cache filled on demand, least recently used out.

The tier is a mechanism: which expert the device cache holds is the policies' business; this tier keeps what was
read from disk last, and a GPU slot's load asks it first (TieredDeviceSlots). A slot a read is landing in is pinned
until its copy to the device is queued, one whose copy out is held (a prefetch waiting for the link: copy_queue.py)
is kept until the copy is queued; a slot's last copy out must finish before it is read into again."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from moetier.engine.slots import HostSlots
from moetier.errors import MoetierError
from moetier.store.format import ALIGN, Manifest
from moetier.store.reader import ON_DEMAND, Completion, ExpertReader

Key = tuple[int, int]  # (layer, expert): an ExpertKey or a plain tuple


class CudaPinning:
    """Page-locks host memory for CUDA (cudaHostRegister), so copies from it to the device run asynchronously at
    the link's speed, and unlocks it (before the memory is unmapped)."""

    def pin(self, ptr: int, nbytes: int) -> None:
        code = _code(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
        if code != 0:
            raise MoetierError(f"cannot page-lock {nbytes:,} bytes of host memory for the GPU (CUDA error {code})",
                               hint="lower --host-memory, or raise the locked-memory limit (ulimit -l)")

    def unpin(self, ptr: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(ptr)


def _code(err) -> int:
    return int(getattr(err, "value", err))


class PinnedHostSlots(HostSlots):
    """HostSlots whose segments are page-locked as they are made (`pinning`: CudaPinning, or a stand-in in tests on
    a machine with no GPU)."""

    def __init__(self, layout, num_slots: int, slack: int = 0, pinning=None) -> None:
        self._pinning, self._locked = pinning or CudaPinning(), []
        super().__init__(layout, num_slots, slack)

    def ensure(self, num_slots: int) -> None:
        super().ensure(num_slots)
        for segment in self._segments[len(self._locked):]:
            ptr = torch.frombuffer(segment, dtype=torch.uint8).data_ptr()
            self._pinning.pin(ptr, len(segment))
            self._locked.append(ptr)

    def close(self) -> None:
        """Unlock the memory and hand its pages back (it is unmapped once nothing refers to it)."""
        for ptr in self._locked:
            self._pinning.unpin(ptr)
        self._locked.clear()
        super().close()


@dataclass
class TierCounts:
    """What the tier served: loads found in host memory, loads read from disk (and their bytes)."""

    hits: int = 0
    reads: int = 0
    bytes_read: int = 0


class HostTier:
    def __init__(self, manifest: Manifest, keys: list[Key], slots: dict[str, int], pinning=None) -> None:
        """`keys`: every expert of the model, in order (a whole pool's slot of a key is its index); `slots`: host
        slots per precision (at most len(keys)); `pinning`: how memory is page-locked (default CudaPinning)."""
        self.manifest, self.keys = manifest, keys
        self.index = {tuple(k): i for i, k in enumerate(keys)}
        self.pools: dict[str, PinnedHostSlots] = {}
        self.whole: dict[str, bool] = {}
        self._where: dict[str, dict[Key, int]] = {}  # precision -> key -> slot holding it
        self._lru: dict[str, OrderedDict[Key, None]] = {}  # precision -> resident keys, least recent first
        self._owner: dict[str, list[Key | None]] = {}  # precision -> slot -> key it holds (or None)
        self._free: dict[str, list[int]] = {}
        self._pinned: dict[str, set[int]] = {}  # slots a read is landing in, not yet copied out
        self._held: dict[str, set[int]] = {}  # slots a copy out of is asked for but held (copy_queue.py)
        self._busy: dict[str, list[torch.cuda.Event | None]] = {}  # the last copy out of each slot
        for precision, n in slots.items():
            if not 0 < n <= len(keys):
                raise MoetierError(f"the host tier needs 1 to {len(keys)} {precision} slots, not {n}")
            self.pools[precision] = PinnedHostSlots(manifest.precisions[precision], n,
                                                    ALIGN if manifest.linked(precision) else 0, pinning)
            self.whole[precision] = n == len(keys)
            self._where[precision], self._lru[precision] = {}, OrderedDict()
            self._owner[precision] = [None] * n
            self._free[precision] = list(range(n - 1, -1, -1))
            self._pinned[precision], self._held[precision], self._busy[precision] = set(), set(), [None] * n
        self.counts = TierCounts()

    @property
    def nbytes(self) -> int:
        return sum(pool.nbytes for pool in self.pools.values())

    def holds(self, precision: str) -> bool:
        """Whether every expert at `precision` is in host memory (a whole pool, filled)."""
        return self.whole.get(precision, False)

    def fill(self, reader: ExpertReader, progress: bool = True) -> None:
        """Read every expert of each whole pool into its slot (once, at start-up)."""
        from moetier.progress import tqdm

        for precision, pool in self.pools.items():
            if not self.whole[precision]:
                continue
            for slot, key in enumerate(self.keys):
                blob = self.manifest.blob(*key, precision)
                reader.submit(blob, pool.read_target(slot, blob.phase, blob.layer), pool.completions[slot], ON_DEMAND)
            for slot, key in enumerate(tqdm(self.keys, desc=f"host memory ({precision})", unit="expert",
                                            disable=not progress or None, leave=False)):
                pool.completions[slot].wait()
                self._resident(precision, tuple(key), slot)
            self._free[precision].clear()

    def lookup(self, key: Key, precision: str) -> int | None:
        """The host slot holding `key` at `precision` (now the most recently used), or None."""
        slot = self._where[precision].get(tuple(key))
        if slot is not None and slot not in self._pinned[precision]:  # (a pinned slot's read has not landed)
            self._lru[precision].move_to_end(tuple(key))
            self.counts.hits += 1
            return slot
        return None

    def admit(self, key: Key, precision: str, nbytes: int) -> int:
        """A slot for `key`'s read from disk, pinned until `unpin`: a free one, or the least recently used one's
        (after its last copy out has finished)."""
        key = tuple(key)
        old = self._where[precision].pop(key, None)
        if old is not None:  # (a read already landing for it: a second load of the same expert reuses the slot)
            self._lru[precision].pop(key, None)
            slot = old
        elif self._free[precision]:
            slot = self._free[precision].pop()
        else:
            slot = self._evict(precision)
        busy = self._busy[precision][slot]
        if busy is not None:
            busy.synchronize()
            self._busy[precision][slot] = None
        self._pinned[precision].add(slot)
        self._resident(precision, key, slot)
        self.counts.reads += 1
        self.counts.bytes_read += nbytes
        return slot

    def _evict(self, precision: str) -> int:
        for key in self._lru[precision]:  # least recent first; pinned slots are few (the reads in flight)
            slot = self._where[precision][key]
            if slot not in self._pinned[precision] and slot not in self._held[precision]:
                del self._lru[precision][key], self._where[precision][key]
                self._owner[precision][slot] = None
                return slot
        raise MoetierError(f"every {precision} slot of the host tier has a read or a copy in flight",
                           hint="give more --host-memory")

    def _resident(self, precision: str, key: Key, slot: int) -> None:
        self._where[precision][key] = slot
        self._lru[precision][key] = None
        self._owner[precision][slot] = key

    def unpin(self, precision: str, slot: int, failed: bool = False) -> None:
        """A read into `slot` has been copied out (or failed: then the slot holds nothing)."""
        self._pinned[precision].discard(slot)
        key = self._owner[precision][slot]
        if failed and key is not None:
            del self._where[precision][key], self._lru[precision][key]
            self._owner[precision][slot] = None
            self._free[precision].append(slot)

    def hold(self, precision: str, slot: int) -> None:
        """A copy out of `slot` is asked for but not yet queued: the slot keeps its expert until `let_go`."""
        self._held[precision].add(slot)

    def let_go(self, precision: str, slot: int) -> None:
        """The held copy out of `slot` was queued (`copied`) or dropped."""
        self._held[precision].discard(slot)

    def copied(self, precision: str, slot: int, event: torch.cuda.Event) -> None:
        """A copy out of `slot` was queued; it must finish before the slot is read into again."""
        self._busy[precision][slot] = event

    def read_target(self, precision: str, slot: int, phase: int = 0, layer: int | None = None) -> memoryview:
        return self.pools[precision].read_target(slot, phase, layer)

    def weights(self, precision: str, slot: int) -> dict[str, torch.Tensor]:
        return self.pools[precision].weights(slot)

    def completion(self, precision: str, slot: int) -> Completion:
        return self.pools[precision].completions[slot]

    def resident(self, precision: str) -> Iterable[Key]:
        return iter(self._lru[precision])

    def close(self) -> None:
        """Wait for the copies out of it, then unlock its memory."""
        for events in self._busy.values():
            for event in events:
                if event is not None:
                    event.synchronize()
        for pool in self.pools.values():
            pool.close()
