"""A GPU's expert slots fed from the host tier (host_tier.py): a load found in host memory is one copy over PCIe,
queued on a side stream the moment the plan asks for it, so it runs while the layer's resident experts compute
(PreScope's and HOBBIT's overlap of transfers with computation); a load not found there is read from disk into a
host slot by the reader's threads (which keeps it for the next time) and copied once it lands.

Ordering, all on the device: the copy into a slot waits for the kernels that read its previous expert (an event
after the last compute call that read it, slot_reads.py — not the compute stream's tail: a prefetch would wait for
the layer it overlaps), and compute on the slot waits for the copy (an event the compute stream waits on). The host
never waits for a copy; it waits only for a disk read, and, before a host slot is read into again, for its last copy
out.

When a copy is queued is the copy queue's business (copy_queue.py, one per executor, shared by its precisions'
pools): an on-demand load's at once, a prefetch's held on the host until the link has room (DemandFirstCopies), so
prefetches never queue ahead of a later on-demand copy. A prefetch's completion fires when its copy is queued: until
then the executor sees it in flight, and can cancel it (`cancel`) or need it now (`promote`, `weights`)."""

from __future__ import annotations

from collections import deque

import torch

from moetier.engine.copy_queue import FifoCopies
from moetier.engine.host_tier import HostTier
from moetier.engine.slot_reads import SlotReads
from moetier.engine.slots import DevicePool, free_device_blocks
from moetier.store.format import PrecisionLayout
from moetier.store.reader import ON_DEMAND, Completion

# one copy in this many is timed for the planner's link cost (RunningCosts.observe_read takes a rate, which a sample
# tells as well): the others save the host a start event's record and an elapsed-time read, two of ~6 CUDA calls a
# copy costs it (host_time.py counts them; each 5-20 us on the H200)
TIME_EVERY = 4


class TieredDeviceSlots(DevicePool):
    waits_on_device = True  # compute on a loaded slot waits for its copy on the device (`weights`), not the host

    def __init__(self, layout: PrecisionLayout, num_slots: int, device: torch.device, tier: HostTier,
                 precision: str, copies: FifoCopies | None = None) -> None:
        """`copies`: the copy queue and its stream (one per executor, shared by its precisions' pools; default a
        FifoCopies of its own)."""
        self.layout, self.device, self.tier, self.precision = layout, device, tier, precision
        self.slot_bytes = layout.blob_bytes
        self.num_slots = 0
        self.completions: list[Completion] = []
        self._blocks: list[torch.Tensor] = []
        self._tensors: list[dict[str, torch.Tensor]] = []
        self._copied: list[bool] = []  # a copy into the slot that compute has not yet been made to wait for
        self._reads = SlotReads(device)
        self._free: list[torch.cuda.Event | None] = []  # per slot: what its asked-for copy waits for (None: nothing)
        # per slot, made once and recorded again for each load (a stream waits on an event's last record as of the
        # wait): when the copy into it started and is done
        self._start: list[torch.cuda.Event] = []  # (timed: what a copy took, for the planner's link cost)
        self._done: list[torch.cuda.Event] = []
        self._copies: list[int] = []  # copies into each slot so far
        self._seq: list[int] = []  # each slot's latest copy's place on the copy stream (`copies.issued` then)
        self._timed: deque[tuple[int, int]] = deque()  # (slot, its copy count) of timed copies not yet read
        self._issued = 0  # copies queued by this pool (every TIME_EVERY-th timed)
        self.copies = copies or FifoCopies(device)
        self._pending: dict[int, int] = {}  # slot -> host slot its read is landing in, not yet copied
        self._held: dict[int, tuple[int, bool]] = {}  # slot -> (host slot, read from disk) of a copy not yet queued
        self.ensure(num_slots)

    def _grow_slot(self) -> None:
        self._copied.append(False)
        self._free.append(None)
        self._start.append(torch.cuda.Event(enable_timing=True))
        self._done.append(torch.cuda.Event(enable_timing=True))
        self._copies.append(0)
        self._seq.append(0)

    def release(self, slots) -> None:
        """Kept: device memory is not handed back slot by slot (the caching allocator would keep it anyway)."""

    def submit(self, reader, key, blob, slot: int, priority: int) -> None:
        """Load expert `key` (`blob`, at this pool's precision) into `slot`: from host memory if the tier has it
        (its copy asked of the copy queue now), else read from disk into a host slot and copied when it lands."""
        if slot in self._pending:  # an earlier load into this slot never used (a prefetch evicted unused)
            self._drop_pending(slot)
        if slot in self._held:
            self._drop_held(slot)
        self._free[slot] = self._reads.before_copy(slot)  # the previous expert's last reader
        if self.layout.layers:  # the views of this blob's layer (a Q4_K_M GGUF's layers differ)
            self._tensors[slot] = self.layout.views(self._blocks[slot], blob.layer)
        host = self.tier.lookup(key, self.precision)
        if host is not None:
            self.tier.hold(self.precision, host)
            self._ask(slot, host, False, priority == ON_DEMAND)
            return
        host = self.tier.admit(key, self.precision, blob.length)
        self._pending[slot] = host
        reader.submit(blob, self.tier.read_target(self.precision, host, blob.phase, blob.layer), self.completions[slot], priority)

    def _drop_pending(self, slot: int) -> None:
        host = self._pending.pop(slot)
        completion = self.completions[slot]
        completion.done.wait()
        self.tier.unpin(self.precision, host, failed=completion.error is not None or completion.cancelled)

    def _drop_held(self, slot: int) -> None:
        """Forget a held copy into `slot` (an expert evicted before its prefetch's copy was queued)."""
        self.copies.drop(self, slot)
        self._forget_held(slot)

    def _forget_held(self, slot: int) -> None:
        host, from_disk = self._held.pop(slot)
        self._let_go(host, from_disk)

    def _let_go(self, host: int, from_disk: bool) -> None:
        if from_disk:  # (a read landed there: its expert is the tier's now)
            self.tier.unpin(self.precision, host)
        else:
            self.tier.let_go(self.precision, host)

    def landed(self, slot: int) -> None:
        """The disk read for `slot` has landed in host memory: its copy is asked for now (a prefetch's: held until
        the link has room)."""
        if slot in self._pending:
            self._copy_pending(slot, demand=False)

    def _copy_pending(self, slot: int, demand: bool) -> None:
        host = self._pending.pop(slot)
        try:
            self.completions[slot].wait()
        except BaseException:
            self.tier.unpin(self.precision, host, failed=True)
            raise
        self._ask(slot, host, True, demand)

    def _ask(self, slot: int, host: int, from_disk: bool, demand: bool) -> None:
        """The copy of host slot `host` into `slot`, to the copy queue: queued now (`demand`) or held."""
        self._held[slot] = (host, from_disk)
        if demand:  # (queued now, so done now: `issue` completes it)
            self.copies.demand(self, slot)
            return
        if not from_disk:  # (done when queued; a read's completion fired when it landed)
            self.completions[slot].held()
        self.copies.hold(self, slot)

    def issue(self, slot: int) -> torch.cuda.Event:
        """Queue the copy asked for `slot` on the copy stream, once the slot's previous expert is free (the copy
        queue's call); the load is complete from the host's side. Returns the event recorded after the copy (the
        slot's, recorded again by its next copy)."""
        host, from_disk = self._held.pop(slot)
        done, stream, free = self._done[slot], self.copies.stream, self._free[slot]
        timed = self._issued % TIME_EVERY == 0
        self._issued += 1
        if free is not None:
            stream.wait_event(free)
        with torch.cuda.stream(stream):
            if timed:
                self._start[slot].record(stream)  # (after the wait: the copy's own time)
            self._blocks[slot].copy_(self.tier.pools[self.precision].region(host), non_blocking=True)
            done.record(stream)
        self._copied[slot] = True
        self._copies[slot] += 1
        self.copies.issued += 1
        self._seq[slot] = self.copies.issued
        if timed:
            self._timed.append((slot, self._copies[slot]))
        self.tier.copied(self.precision, host, done)
        self._let_go(host, from_disk)
        if not from_disk:
            self.completions[slot].complete()
        return done

    def promote(self, reader, slot: int) -> None:
        """A load in flight is needed now: its held copy queued at once, or its disk read moved up."""
        if not self.copies.force(self, slot):
            reader.promote(self.completions[slot])

    def cancel(self, reader, slot: int) -> bool:
        """Cancel a prefetch into `slot` if its copy (or its disk read) has not started: whether it was."""
        if slot in self._held and self.copies.drop(self, slot):
            self._forget_held(slot)
            completion = self.completions[slot]
            completion.cancelled = True
            completion.done.set()
            return True
        return reader.cancel(self.completions[slot])

    def link_activity(self) -> tuple[int, float]:
        """(bytes, seconds) of the timed copies to the device finished since the last call (one in TIME_EVERY):
        what a load through the host tier costs on the link, for the planner (RunningCosts.observe_read). A slot
        copied into again before its timed copy was read counts only if that later copy is timed too."""
        nbytes, seconds = 0, 0.0
        # one stream: once the newest is done every copy before it is, and one query tells it (not one a copy)
        newest = self._timed[-1][0] if self._timed else None
        all_done = newest is not None and self._done[newest].query()
        while self._timed:
            slot, n = self._timed[0]
            if n == self._copies[slot]:
                if not all_done and not self._done[slot].query():  # (the copies after it are not done either)
                    break
                nbytes += self.slot_bytes
                seconds += self._start[slot].elapsed_time(self._done[slot]) / 1e3
            self._timed.popleft()
        return nbytes, seconds

    def close(self) -> None:
        """The slots' device memory handed back now (the host tier's is its own: HostTier.close)."""
        free_device_blocks(self.device, self._blocks)

    def weights(self, slot: int) -> dict[str, torch.Tensor]:
        return self.weights_for([slot])[0]

    def weights_for(self, slots: list[int]) -> list[dict[str, torch.Tensor]]:
        """Each slot's weights, for one compute call, which waits on the device (not the host) for the copies into
        them: for the latest of them alone — one stream, so every earlier copy is done by then — one CUDA call
        where a wait a slot took one each (a layer's loaded experts go in one call: expert_executor.py)."""
        for slot in slots:
            if slot in self._pending:
                self._copy_pending(slot, demand=True)
            elif slot in self._held:
                self.copies.force(self, slot)
        self.copies.feed()
        latest = None
        for slot in slots:
            if self._copied[slot]:
                if latest is None or self._seq[slot] > self._seq[latest]:
                    latest = slot
                self._copied[slot] = False
            self._reads.read(slot)
        if latest is not None:
            torch.cuda.current_stream(self.device).wait_event(self._done[latest])
        return [self._tensors[slot] for slot in slots]
