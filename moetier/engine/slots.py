"""Preallocated expert slots of one precision: where reads land and what kernels compute from.

`HostSlots` (the CPU): one anonymous mapping per segment (page-aligned, so O_DIRECT reads straight into it), cut
into blob-sized slots, each with its tensor views made once; reads land where compute reads. A linked store's slots
have a page of slack: a blob that starts mid-page in its checkpoint file lands as far into its slot's first page,
so its whole pages still go straight in (the views move with it, once per load).

`DeviceSlots` (a GPU with no host tier, `--host-memory 0`): the slots are device memory; a read lands in one of a
few pinned host staging buffers and is copied to its slot on a side stream once the compute that last read the slot
is done (slot_reads.py), and compute waits for that copy on the device, not on the host. With a host tier the slots
are `TieredDeviceSlots` (tiered_slots.py). Run on an H200 (tests/engine/test_cuda.py, bench/gpu/run.sh); CI has no
GPU and exercises `HostSlots`.

Each gives the executor `submit(reader, key, blob, slot, priority)` (load an expert into a slot), `promote(reader,
slot)` and `cancel(reader, slot)` (a prefetch needed now, or proved wrong), `landed(slot)` (its read has finished: a
device pool starts its copy now rather than when it is used) and `weights(slot)` once the slot's load has completed;
the low tier and the host tier fill slots through `read_target(slot)`."""

from __future__ import annotations

import mmap
from collections import OrderedDict
from collections.abc import Iterable

import torch

from moetier.engine.huge_pages import private_mapping
from moetier.engine.slot_reads import SlotReads
from moetier.store.format import ALIGN, PrecisionLayout
from moetier.store.reader import Completion


class HostSlots:
    waits_on_device = False  # a load's slot is ready once its read completes (the executor waits on the host)

    def __init__(self, layout: PrecisionLayout, num_slots: int, slack: int = 0) -> None:
        """`slack`: bytes each slot has beyond a blob, so a linked blob can start as far into the slot's first page
        as it starts into its file's (ALIGN for a linked store, 0 for a store's own aligned blobs)."""
        self.layout = layout
        self.slot_bytes = layout.blob_bytes
        self.stride = self.slot_bytes + slack
        self.num_slots = 0
        self.views: list[memoryview] = []
        self.completions: list[Completion] = []
        self._tensors: list[dict[str, torch.Tensor]] = []
        self._regions: list[tuple[torch.Tensor, memoryview]] = []  # each slot's whole stride, as bytes
        self._phases: list[int] = []  # where in its region each slot's blob starts now
        self._blobs: list[torch.Tensor] = []  # each slot's blob as bytes, where it starts now (`region`)
        self._segments: list[mmap.mmap] = []
        self._where: list[tuple[mmap.mmap, int]] = []  # each slot's segment and offset there (for `release`)
        self.ensure(num_slots)

    def ensure(self, num_slots: int) -> None:
        """At least `num_slots` slots (a cache that grew adds a segment; nothing moves)."""
        extra = num_slots - self.num_slots
        if extra <= 0:
            return
        segment = private_mapping(extra * self.stride)
        self._segments.append(segment)
        flat = torch.frombuffer(segment, dtype=torch.uint8)
        # Fault every page in now: the budget is really reserved (and counted in RSS), and no read in the hot loop
        # pays for first-touch page faults.
        flat.zero_()
        view = memoryview(segment)
        for i in range(extra):
            a, b = i * self.stride, (i + 1) * self.stride
            self._regions.append((flat[a:b], view[a:b]))
            self._where.append((segment, a))
            self._phases.append(0)
            self.views.append(view[a:a + self.slot_bytes])
            self.completions.append(Completion())
            self._blobs.append(flat[a:a + self.slot_bytes])
            self._tensors.append(self.layout.views(self._blobs[-1]))
        self.num_slots = num_slots

    def release(self, slots: Iterable[int]) -> None:
        """Hand the pages of `slots` (none holding an expert: a cache that shrank) back to the system; a slot reused
        later faults its pages in again as its next read lands. Its stride is whole pages (blobs are ALIGN-padded,
        the slack is ALIGN), so nothing of a neighbour goes."""
        for slot in slots:
            segment, offset = self._where[slot]
            segment.madvise(mmap.MADV_DONTNEED, offset, self.stride)

    def close(self) -> None:
        """Hand every slot's pages back to the system now (the engine is closing): whatever still names the slots —
        a scheduler, a policy, an engine object the caller keeps — keeps address space, not memory."""
        for segment in self._segments:
            segment.madvise(mmap.MADV_DONTNEED)

    def read_target(self, slot: int, phase: int = 0, layer: int | None = None) -> memoryview:
        """Where the slot's next blob lands: `phase` bytes into its first page (BlobRef.phase; 0 without slack);
        `layer`: the blob's, where the layout differs by layer (the views follow it)."""
        moved = phase != self._phases[slot] and phase + self.slot_bytes <= self.stride
        if moved or self.layout.layers:  # (per load, never per hit)
            flat, view = self._regions[slot]
            phase = phase if moved else self._phases[slot]
            self.views[slot] = view[phase:phase + self.slot_bytes]
            self._blobs[slot] = flat[phase:phase + self.slot_bytes]
            self._tensors[slot] = self.layout.views(self._blobs[slot], layer)
            self._phases[slot] = phase
        return self.views[slot]

    def submit(self, reader, key, blob, slot: int, priority: int) -> None:
        """Read `blob` (expert `key`) into `slot`; its completion fires when the bytes are there."""
        reader.submit(blob, self.read_target(slot, blob.phase, blob.layer), self.completions[slot], priority)

    def promote(self, reader, slot: int) -> None:
        """The load into `slot` is needed now: its chunks not yet read go on-demand."""
        reader.promote(self.completions[slot])

    def cancel(self, reader, slot: int) -> bool:
        """Cancel the load into `slot` if none of its reads has started: whether it was."""
        return reader.cancel(self.completions[slot])

    def landed(self, slot: int) -> None:
        """Nothing to do: a read lands where compute reads."""

    def link_activity(self) -> tuple[int, float]:
        """Nothing beyond the reader's: a load is its read (RunningCosts hears the reader's activity)."""
        return 0, 0.0

    def weights(self, slot: int) -> dict[str, torch.Tensor]:
        return self._tensors[slot]

    def weights_for(self, slots: list[int]) -> list[dict[str, torch.Tensor]]:
        """Each slot's weights, for one compute call."""
        return [self._tensors[slot] for slot in slots]

    def device_done(self) -> None:
        """Nothing to learn: no device (DevicePool's)."""

    def queued(self) -> None:
        """Nothing to mark: the host's compute is done when its call returns."""

    def read_all(self) -> None:
        """Nothing to mark (as `queued`)."""

    def region(self, slot: int) -> torch.Tensor:
        """The slot's blob as bytes (uint8, where its last read put it): what a copy to a device reads."""
        return self._blobs[slot]

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.stride


class DevicePool:
    """What a GPU's pools of slots share (DeviceSlots, and TieredDeviceSlots behind a host tier): the marks after
    each compute call that read their slots (`_reads`, SlotReads: a copy into a slot waits for its last reader), and
    the bytes `num_slots` of `slot_bytes` take; growing to more slots (`ensure`: each a block of device memory, its
    tensors' views, its completion, and what the pool keeps a slot, `_grow_slot`)."""

    def ensure(self, num_slots: int) -> None:
        for _ in range(self.num_slots, num_slots):
            block = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
            self._blocks.append(block)
            self._tensors.append(self.layout.views(block))
            self.completions.append(Completion())
            self._grow_slot()
        self.num_slots = max(self.num_slots, num_slots)
        self._reads.ensure(self.num_slots)

    def _grow_slot(self) -> None:
        """The pool's own state for one more slot."""
        raise NotImplementedError

    def weights_for(self, slots: list[int]) -> list[dict[str, torch.Tensor]]:
        """Each slot's weights, for one compute call (each slot's `weights`)."""
        return [self.weights(slot) for slot in slots]

    def device_done(self) -> None:
        """The host has waited for the compute stream's work so far (a layer's routing): every compute that read a
        slot is done (SlotReads.device_done)."""
        self._reads.device_done()

    def queued(self) -> None:
        """The compute reading the slots whose weights were taken since the last call is queued."""
        self._reads.queued()

    def read_all(self) -> None:
        """A step reads every slot without taking their weights one by one (ResidentLayers)."""
        self._reads.read_all()

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes


class DeviceSlots(DevicePool):
    """Slots in device memory, fed through `staging` pinned host buffers (reads in flight at once beyond that
    wait for the oldest pending copy)."""

    waits_on_device = True  # compute on a loaded slot waits for its copy on the device (`weights`), not the host

    def __init__(self, layout: PrecisionLayout, num_slots: int, device: torch.device, staging: int = 8) -> None:
        self.layout, self.device = layout, device
        self.slot_bytes = layout.blob_bytes
        self.num_slots = 0
        self.completions: list[Completion] = []
        self._blocks: list[torch.Tensor] = []  # each slot's bytes on the device
        self._tensors: list[dict[str, torch.Tensor]] = []
        self._copied: list[torch.cuda.Event | None] = []
        self._reads = SlotReads(device)
        self._after: list[torch.cuda.Event | None] = []  # per slot: what the copy into it waits for (None: nothing)
        self._stream = torch.cuda.Stream(device)
        self._staging = [self._pinned() for _ in range(staging)]
        self._staging_done: list[torch.cuda.Event | None] = [None] * staging  # the copy out of each buffer
        self._free = list(range(staging))
        self._pending: OrderedDict[int, int] = OrderedDict()  # slot -> staging buffer holding its read
        self.ensure(num_slots)

    def _pinned(self) -> tuple[torch.Tensor, memoryview]:
        raw = torch.empty(self.slot_bytes + ALIGN, dtype=torch.uint8, pin_memory=True)
        skip = -raw.data_ptr() % ALIGN  # O_DIRECT needs an aligned buffer
        buf = raw[skip:skip + self.slot_bytes]
        return buf, memoryview(buf.numpy()).cast("B")

    def _grow_slot(self) -> None:
        self._copied.append(None)
        self._after.append(None)

    def release(self, slots: Iterable[int]) -> None:
        """Kept: device memory is not handed back slot by slot (the caching allocator would keep it anyway)."""

    def close(self) -> None:
        """The slots' device memory handed back to the device now, once the copies into them are done; the few
        staging buffers go with the object."""
        free_device_blocks(self.device, self._blocks)

    def read_target(self, slot: int, phase: int = 0, layer: int | None = None) -> memoryview:
        """A staging buffer (`phase` unused: an unaligned linked blob goes through the reader's bounce buffers);
        `layer`: the blob's, where the layout differs by layer (the slot's views follow it)."""
        if self.layout.layers:
            self._tensors[slot] = self.layout.views(self._blocks[slot], layer)
        self._after[slot] = self._reads.before_copy(slot)  # the previous expert's last reader
        if slot in self._pending:  # an earlier read into this slot was never used (a prefetch evicted unused)
            self.completions[slot].done.wait()
            self._free.append(self._pending.pop(slot))
        if not self._free:  # every staging buffer holds a read not yet copied: copy the oldest out
            self._copy(next(iter(self._pending)))
        i = self._free.pop()
        if self._staging_done[i] is not None:  # the last copy out of this buffer must be done before reuse
            self._staging_done[i].synchronize()
        self._pending[slot] = i
        return self._staging[i][1]

    def submit(self, reader, key, blob, slot: int, priority: int) -> None:
        reader.submit(blob, self.read_target(slot, blob.phase, blob.layer), self.completions[slot], priority)

    promote = HostSlots.promote
    cancel = HostSlots.cancel

    def link_activity(self) -> tuple[int, float]:
        """The reader's activity prices a load (the copy out of staging is a small part of it)."""
        return 0, 0.0

    def landed(self, slot: int) -> None:
        """The read has landed in its staging buffer: copy it to the device now, freeing the buffer."""
        if slot in self._pending:
            self._copy(slot)

    def _copy(self, slot: int) -> None:
        """Copy a completed read from its staging buffer to the slot on the side stream."""
        self.completions[slot].wait()
        i = self._pending.pop(slot)
        event = torch.cuda.Event()
        if self._after[slot] is not None:  # kernels may still read this slot's previous expert: copy after them
            self._stream.wait_event(self._after[slot])
        with torch.cuda.stream(self._stream):
            self._blocks[slot].copy_(self._staging[i][0], non_blocking=True)
            event.record(self._stream)
        self._copied[slot], self._staging_done[i] = event, event
        self._free.append(i)

    def weights(self, slot: int) -> dict[str, torch.Tensor]:
        if slot in self._pending:
            self._copy(slot)
        event = self._copied[slot]
        if event is not None:  # compute waits for the copy on the device, not on the host
            torch.cuda.current_stream(self.device).wait_event(event)
            self._copied[slot] = None
        self._reads.read(slot)
        return self._tensors[slot]


def free_device_blocks(device: torch.device, blocks: list[torch.Tensor]) -> None:
    """Each block's storage emptied, its memory handed back whatever still names it (the engine refuses work once
    closed), after every copy queued on the device is done — and out of torch's caching allocator: the next
    engine's budget reads the device's free memory (torch.cuda.mem_get_info), which counts cached blocks as taken."""
    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.synchronize(device)
    for block in blocks:
        block.untyped_storage().resize_(0)
    if gpu:
        torch.cuda.empty_cache()


def make_slots(layout: PrecisionLayout, num_slots: int, device: torch.device,
               linked: bool = False) -> HostSlots | DeviceSlots:
    """`linked`: the blobs may lie unaligned in a checkpoint's files (host slots get a page of slack for them)."""
    if device.type == "cpu":
        return HostSlots(layout, num_slots, ALIGN if linked else 0)
    return DeviceSlots(layout, num_slots, device)
