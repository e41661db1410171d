"""Preallocated expert slots of one precision: where reads land and what kernels compute from.

`HostSlots` (the CPU): one anonymous mapping per segment (page-aligned, so O_DIRECT reads straight into it), cut
into blob-sized slots, each with its tensor views made once; reads land where compute reads.

`DeviceSlots` (a GPU): the slots are device memory; a read lands in one of a few pinned host staging buffers and
is copied to its slot on a side stream, and compute waits for that copy on the device, not on the host. Written
for CUDA and not run here (this machine has no GPU); the tests exercise `HostSlots`.

Both give the reader `read_target(slot)` and the executor `weights(slot)` once the slot's read has completed."""

from __future__ import annotations

import mmap
from collections import OrderedDict

import torch

from moetier.store.format import ALIGN, PrecisionLayout
from moetier.store.reader import Completion


class HostSlots:
    def __init__(self, layout: PrecisionLayout, num_slots: int) -> None:
        self.layout = layout
        self.slot_bytes = layout.blob_bytes
        self.num_slots = 0
        self.views: list[memoryview] = []
        self.completions: list[Completion] = []
        self._tensors: list[dict[str, torch.Tensor]] = []
        self._segments: list[mmap.mmap] = []
        self.ensure(num_slots)

    def ensure(self, num_slots: int) -> None:
        """At least `num_slots` slots (a cache that grew adds a segment; nothing moves)."""
        extra = num_slots - self.num_slots
        if extra <= 0:
            return
        segment = mmap.mmap(-1, extra * self.slot_bytes)
        self._segments.append(segment)
        flat = torch.frombuffer(segment, dtype=torch.uint8)
        # Fault every page in now: the budget is really reserved (and counted in RSS), and no read in the hot loop
        # pays for first-touch page faults.
        flat.zero_()
        view = memoryview(segment)
        for i in range(extra):
            a, b = i * self.slot_bytes, (i + 1) * self.slot_bytes
            self.views.append(view[a:b])
            self.completions.append(Completion())
            self._tensors.append(self.layout.views(flat[a:b]))
        self.num_slots = num_slots

    def read_target(self, slot: int) -> memoryview:
        return self.views[slot]

    def weights(self, slot: int) -> dict[str, torch.Tensor]:
        return self._tensors[slot]

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes


class DeviceSlots:
    """Slots in device memory, fed through `staging` pinned host buffers (reads in flight at once beyond that
    wait for the oldest pending copy)."""

    def __init__(self, layout: PrecisionLayout, num_slots: int, device: torch.device, staging: int = 8) -> None:
        self.layout, self.device = layout, device
        self.slot_bytes = layout.blob_bytes
        self.num_slots = 0
        self.completions: list[Completion] = []
        self._blocks: list[torch.Tensor] = []  # each slot's bytes on the device
        self._tensors: list[dict[str, torch.Tensor]] = []
        self._copied: list[torch.cuda.Event | None] = []
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

    def ensure(self, num_slots: int) -> None:
        for _ in range(self.num_slots, num_slots):
            block = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
            self._blocks.append(block)
            self._tensors.append(self.layout.views(block))
            self.completions.append(Completion())
            self._copied.append(None)
        self.num_slots = max(self.num_slots, num_slots)

    def read_target(self, slot: int) -> memoryview:
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

    def _copy(self, slot: int) -> None:
        """Copy a completed read from its staging buffer to the slot on the side stream."""
        self.completions[slot].wait()
        i = self._pending.pop(slot)
        event = torch.cuda.Event()
        # kernels launched on the compute stream may still read this slot's previous expert: copy after them
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
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
        return self._tensors[slot]

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes


def make_slots(layout: PrecisionLayout, num_slots: int, device: torch.device) -> HostSlots | DeviceSlots:
    return HostSlots(layout, num_slots) if device.type == "cpu" else DeviceSlots(layout, num_slots, device)
