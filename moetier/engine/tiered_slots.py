"""A GPU's expert slots fed from the host tier (host_tier.py): a load found in host memory is one copy over PCIe,
queued on a side stream the moment the plan asks for it, so it runs while the layer's resident experts compute
(PreScope's and HOBBIT's overlap of transfers with computation); a load not found there is read from disk into a
host slot by the reader's threads (which keeps it for the next time) and copied once it lands.

Ordering, all on the device: the copy into a slot waits for the kernels queued before it on the compute stream
(the slot's previous expert may still be read by them: an event recorded when the load is asked for), and compute
on the slot waits for the copy (an event the compute stream waits on). The host never waits for a copy; it waits
only for a disk read, and, before a host slot is read into again, for its last copy out."""

from __future__ import annotations

from collections import deque

import torch

from moetier.engine.host_tier import HostTier
from moetier.store.format import PrecisionLayout
from moetier.store.reader import Completion


class TieredDeviceSlots:
    waits_on_device = True  # compute on a loaded slot waits for its copy on the device (`weights`), not the host

    def __init__(self, layout: PrecisionLayout, num_slots: int, device: torch.device, tier: HostTier,
                 precision: str, stream: torch.cuda.Stream | None = None) -> None:
        """`stream`: the copy stream (one per executor, shared by its precisions' pools; default a new one)."""
        self.layout, self.device, self.tier, self.precision = layout, device, tier, precision
        self.slot_bytes = layout.blob_bytes
        self.num_slots = 0
        self.completions: list[Completion] = []
        self._blocks: list[torch.Tensor] = []
        self._tensors: list[dict[str, torch.Tensor]] = []
        self._copied: list[bool] = []  # a copy into the slot that compute has not yet been made to wait for
        # per slot, made once and recorded again for each load (a stream waits on an event's last record as of the
        # wait): when the slot's previous expert is no longer read, and when the copy into it is done
        self._free: list[torch.cuda.Event] = []
        self._start: list[torch.cuda.Event] = []  # (timed: what a copy took, for the planner's link cost)
        self._done: list[torch.cuda.Event] = []
        self._copies: list[int] = []  # copies into each slot so far
        self._timed: deque[tuple[int, int]] = deque()  # (slot, its copy count) of copies not yet timed
        self._stream = stream or torch.cuda.Stream(device)
        self._pending: dict[int, int] = {}  # slot -> host slot its read is landing in, not yet copied
        self.ensure(num_slots)

    def ensure(self, num_slots: int) -> None:
        for _ in range(self.num_slots, num_slots):
            block = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
            self._blocks.append(block)
            self._tensors.append(self.layout.views(block))
            self.completions.append(Completion())
            self._copied.append(False)
            self._free.append(torch.cuda.Event())
            self._start.append(torch.cuda.Event(enable_timing=True))
            self._done.append(torch.cuda.Event(enable_timing=True))
            self._copies.append(0)
        self.num_slots = max(self.num_slots, num_slots)

    def release(self, slots) -> None:
        """Kept: device memory is not handed back slot by slot (the caching allocator would keep it anyway)."""

    def submit(self, reader, key, blob, slot: int, priority: int) -> None:
        """Load expert `key` (`blob`, at this pool's precision) into `slot`: from host memory if the tier has it
        (the copy queued now), else read from disk into a host slot and copied when it lands."""
        if slot in self._pending:  # an earlier load into this slot never used (a prefetch evicted unused)
            self._drop_pending(slot)
        self._free[slot].record(torch.cuda.current_stream(self.device))  # the previous expert: read by what is queued
        if self.layout.layers:  # the views of this blob's layer (a Q4_K_M GGUF's layers differ)
            self._tensors[slot] = self.layout.views(self._blocks[slot], blob.layer)
        host = self.tier.lookup(key, self.precision)
        if host is not None:
            self._copy(host, slot)
            self.completions[slot].complete()
            return
        host = self.tier.admit(key, self.precision, blob.length)
        self._pending[slot] = host
        reader.submit(blob, self.tier.read_target(self.precision, host, blob.phase, blob.layer), self.completions[slot], priority)

    def _drop_pending(self, slot: int) -> None:
        host = self._pending.pop(slot)
        completion = self.completions[slot]
        completion.done.wait()
        self.tier.unpin(self.precision, host, failed=completion.error is not None or completion.cancelled)

    def landed(self, slot: int) -> None:
        """The disk read for `slot` has landed in host memory: queue its copy now."""
        if slot in self._pending:
            self._copy_pending(slot)

    def _copy_pending(self, slot: int) -> None:
        host = self._pending.pop(slot)
        try:
            self.completions[slot].wait()
        except BaseException:
            self.tier.unpin(self.precision, host, failed=True)
            raise
        self._copy(host, slot)
        self.tier.unpin(self.precision, host)

    def _copy(self, host: int, slot: int) -> None:
        """Host slot `host` to device slot `slot` on the copy stream, once the slot's previous expert is free."""
        done = self._done[slot]
        self._stream.wait_event(self._free[slot])
        with torch.cuda.stream(self._stream):
            self._start[slot].record(self._stream)  # (after the wait: the copy's own time)
            self._blocks[slot].copy_(self.tier.pools[self.precision].region(host), non_blocking=True)
            done.record(self._stream)
        self._copied[slot] = True
        self._copies[slot] += 1
        self._timed.append((slot, self._copies[slot]))
        self.tier.copied(self.precision, host, done)

    def link_activity(self) -> tuple[int, float]:
        """(bytes, seconds) of the copies to the device finished since the last call: what a load through the
        host tier costs on the link, for the planner (RunningCosts.observe_read). A slot copied into again before
        its copy was timed counts once, with its later copy."""
        nbytes, seconds = 0, 0.0
        while self._timed:
            slot, n = self._timed[0]
            if n == self._copies[slot]:
                if not self._done[slot].query():  # (one stream: the copies after it are not done either)
                    break
                nbytes += self.slot_bytes
                seconds += self._start[slot].elapsed_time(self._done[slot]) / 1e3
            self._timed.popleft()
        return nbytes, seconds

    def weights(self, slot: int) -> dict[str, torch.Tensor]:
        if slot in self._pending:
            self._copy_pending(slot)
        if self._copied[slot]:  # compute waits for the copy on the device, not on the host
            torch.cuda.current_stream(self.device).wait_event(self._done[slot])
            self._copied[slot] = False
        return self._tensors[slot]

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes
