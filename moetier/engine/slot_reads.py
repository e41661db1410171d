"""When each slot of a GPU's expert cache was last read by compute queued on the device, so that a copy overwriting
the slot waits for that compute alone.

A copy into a slot must not start before the kernels that read the slot's previous expert are done; queued on the
copy stream, it waits for an event on the compute stream. Recorded at the compute stream's tail when the copy is
asked for (what moetier did until now), that event covers everything queued since the slot was last read: a
prefetch for the next layer, asked for once this layer's experts are queued, waited for all of them — and every
copy queued behind it on the one copy stream waited too, so the link idled while the layer computed (the overlap
HOBBIT's and PreScope's pipelines are built for; the simulator has always priced a prefetch as free to start once
the link is). A slot the cache evicts was, by the policy's choice, read long before: here each compute call that
reads slots is followed by a mark (`queued`), and a copy waits for the mark after the slot's last read, done long
since (no wait at all once known done).

Correctness never rests on the callers: a slot handed out (`read`) whose compute was not marked yet, and every slot
after a step that read them all without asking (`read_all`: ResidentLayers' tables), waits for the tail as before."""

from __future__ import annotations

import torch


class SlotReads:
    def __init__(self, device: torch.device, marks: int = 64) -> None:
        if marks < 1:
            raise ValueError(f"marks must be at least 1, not {marks}")
        self.device = device
        self._marks = [torch.cuda.Event() for _ in range(marks)]  # a ring: mark n is _marks[n % marks]
        self._recorded = 0  # marks recorded so far
        self._done = -1  # every mark up to this one is known done
        self._last: list[int] = []  # per slot: the mark after its last read; -1: never read
        self._unmarked: set[int] = set()  # slots handed out since the compute reading them was last marked
        self._floor = -1  # a mark after a step that read every slot
        self._everything = False  # a step read every slot since the last mark

    def ensure(self, num_slots: int) -> None:
        self._last.extend([-1] * (num_slots - len(self._last)))

    def read(self, slot: int) -> None:
        """`slot`'s weights were handed out: compute reading them is about to be queued."""
        self._unmarked.add(slot)

    def read_all(self) -> None:
        """A step reads every slot without handing them out one by one."""
        self._everything = True

    def queued(self) -> None:
        """The compute reading the slots handed out since the last call is queued: mark its end."""
        if self._unmarked:
            self._mark()

    def device_done(self) -> None:
        """The host has waited for everything queued on the compute stream (a layer's routing read back): every
        mark recorded so far is done — no copy waits for one, and the ring reuses one without synchronizing."""
        self._done = self._recorded - 1

    def before_copy(self, slot: int) -> torch.cuda.Event | None:
        """What a copy into `slot` waits for on the device: the mark after the compute that last read it; None
        when that is known done (or the slot was never read)."""
        if self._everything or slot in self._unmarked:
            self._mark()  # (at the tail: as good as the reads' own mark, and never earlier than they)
        n = max(self._last[slot], self._floor)
        return None if n <= self._done else self._marks[n % len(self._marks)]

    def _mark(self) -> None:
        n = self._recorded
        event = self._marks[n % len(self._marks)]
        if n - len(self._marks) > self._done:  # the mark it held, not yet known done (done long since: the host
            event.synchronize()  # waited for later routings, which `device_done` tells where it is called)
            self._done = n - len(self._marks)
        event.record(torch.cuda.current_stream(self.device))
        self._recorded += 1
        for slot in self._unmarked:
            self._last[slot] = n
        self._unmarked.clear()
        if self._everything:
            self._floor, self._everything = n, False
