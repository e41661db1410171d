"""The order a GPU's copies from host memory take on its copy stream (TieredDeviceSlots' loads through the host tier).

A copy queued on a CUDA stream can be neither overtaken nor called back: an on-demand copy queued behind prefetches
waits for all of them, the wrong ones too (HOBBIT §4.2: "we must wait for the loading of the incorrect expert to
finish before we can begin loading the required experts"). `DemandFirstCopies` keeps prefetch copies on the host
and lets one onto the stream only while it has room (as many unfinished copies as the link finishes while the host
is away queueing a dense part, at least two), so an on-demand copy, queued at once, waits at most for those —
HOBBIT's task queue (on-demand tasks before prediction ones) and PreScope's event-driven I/O (the next transfer
issued as one finishes), and the order the simulator prices (sim/executor.py: queued prefetches start behind
on-demand reads, a started one is never interrupted). A held prefetch can still be cancelled for free when its layer
proves it wrong. The host lets held copies on wherever it passes (a load asked, a slot's weights taken, a layer's
end) and while it waits for a layer's routing (`wait_current`), which on a GPU is where the host waits anyway.
`FifoCopies` queues every copy when it is asked for: the order the first GPU runs measured (bench/gpu/bench_gpu.py
keeps a row of it).

A pool hands the queue `(pool, slot)` and queues the copy itself when told (`pool.issue(slot)`, on `self.stream`)."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch


@dataclass
class CopyCounts:
    """What a copy queue did with prefetch copies (a benchmark's row reports it): asked for, held back for want of
    room at the time, queued early because a layer needed them, dropped unqueued (proved wrong, or evicted), and
    let on while the host waited for a routing."""

    asked: int = 0
    held: int = 0
    forced: int = 0
    dropped: int = 0
    fed_waiting: int = 0


class FifoCopies:
    """Every copy queued on the stream the moment it is asked for."""

    def __init__(self, device: torch.device, costs=None) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.counts = CopyCounts()
        self.issued = 0  # copies queued on the stream so far, by every pool sharing it (their order on it)

    def demand(self, pool, slot: int) -> None:
        pool.issue(slot)

    def hold(self, pool, slot: int) -> None:
        self.counts.asked += 1
        pool.issue(slot)

    def force(self, pool, slot: int) -> bool:
        """Queue a held copy now; False: none was held."""
        return False

    def drop(self, pool, slot: int) -> bool:
        """Forget a held copy, never queued (its prefetch proved wrong); False: none was held."""
        return False

    def feed(self) -> bool:
        """Let held copies onto the stream while it has room; whether any stays held."""
        return False

    def wait_current(self) -> None:
        """Wait on the host for what is queued on the compute stream (a layer's routing on its way back)."""
        torch.cuda.current_stream(self.device).synchronize()


class DemandFirstCopies(FifoCopies):
    """On-demand copies queued at once; prefetch copies held on the host until the stream has room: fewer unfinished
    copies than the link finishes while the host is away — from its last look to the next layer's routing, queueing
    the dense part, when it cannot let copies on — and never fewer than `depth` (default 2: one running and one
    behind it). The link then stays busy through the host's absence, and what it was given is done about when the
    routing asks its on-demand copies. The absence is the host's own time (smoothed), not the device's: measured
    against the device's, a link kept busy would lengthen the wait it is sized by. A copy's time: `costs.read_s`
    (RunningCosts, from the copies' own CUDA events)."""

    def __init__(self, device: torch.device, costs=None, depth: int = 2, marks: int = 256,
                 smoothing: float = 0.2) -> None:
        if depth < 1 or marks <= depth:
            raise ValueError(f"depth {depth} must be at least 1 and below marks {marks}")
        super().__init__(device)
        self.costs, self.depth, self.smoothing, self.marks = costs, depth, smoothing, marks
        self._held: OrderedDict[tuple[object, int], None] = OrderedDict()  # (pool, slot), oldest first
        # the event each copy queued recorded after it (its pool's: one a slot, recorded again by the slot's next
        # copy — which then reads later than this copy's end, never earlier: a prefetch held a little longer at
        # worst), at most `marks`: the stream's unfinished copies, oldest first (one stream: a copy is done once a
        # later one is)
        self._unfinished: deque[torch.cuda.Event] = deque()
        self._routed = torch.cuda.Event()  # what wait_current waits for
        self._looked: float | None = None  # when the host last let copies on
        self.away_s: float | None = None  # how long the host is away before a routing's wait, smoothed

    def demand(self, pool, slot: int) -> None:
        self._issue(pool, slot)

    def hold(self, pool, slot: int) -> None:
        self.counts.asked += 1
        self._held[(pool, slot)] = None
        if self.feed():
            self.counts.held += (pool, slot) in self._held

    def force(self, pool, slot: int) -> bool:
        if (pool, slot) not in self._held:
            return False
        del self._held[(pool, slot)]
        self._issue(pool, slot)
        self.counts.forced += 1
        return True

    def drop(self, pool, slot: int) -> bool:
        if (pool, slot) not in self._held:
            return False
        del self._held[(pool, slot)]
        self.counts.dropped += 1
        return True

    def feed(self) -> bool:
        self._looked = time.perf_counter()
        if not self._held:  # (what a layer's every slot taken asks, with nothing held: the common case)
            return False
        room = self.room()
        while self._held and self._busy() < room:
            (pool, slot), _ = self._held.popitem(last=False)
            self._issue(pool, slot)
        return bool(self._held)

    def wait_current(self) -> None:
        """Wait for the compute stream's work so far, letting held copies on as the link frees (spinning, as CUDA's
        own wait does by default, and yielding the interpreter to the reader's threads between looks)."""
        if self._looked is not None:
            away = time.perf_counter() - self._looked
            self.away_s = away if self.away_s is None else self.smoothing * away + (1 - self.smoothing) * self.away_s
        self._routed.record(torch.cuda.current_stream(self.device))
        while not self._routed.query():
            before = len(self._held)
            left = self.feed()
            self.counts.fed_waiting += before - len(self._held)
            if not left:
                self._routed.synchronize()
                return
            time.sleep(0)

    def room(self) -> int:
        """How many unfinished copies the stream may hold before a prefetch's is held back."""
        copy_s = None if self.costs is None else self.costs.read_s
        if not self.away_s or not copy_s:
            return self.depth
        return max(self.depth, min(int(self.away_s / copy_s) + 1, self.marks - 1))

    def _issue(self, pool, slot: int) -> None:
        done = pool.issue(slot)  # (the copy's own completion event: no mark of our own to record)
        if len(self._unfinished) == self.marks:  # (hundreds of copies unfinished: wait for the oldest)
            self._unfinished.popleft().synchronize()
        self._unfinished.append(done)

    def _busy(self) -> int:
        """The stream's copies not yet finished."""
        while self._unfinished and self._unfinished[0].query():
            self._unfinished.popleft()
        return len(self._unfinished)


COPY_ORDERS = {"demand-first": DemandFirstCopies, "fifo": FifoCopies}
