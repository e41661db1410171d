"""Fewer compute threads while other processes want the cores.

A decode step is a few hundred OpenMP regions, each split statically across the threads and ended by a barrier.
When another process runs on one of the cores, the thread the scheduler parks there holds up every region for a
time slice: resident decode of an OLMoE-width model beside one CPU hog per core ran 20-35x slower in some runs
(bench/bench_contention.py), however the waiting threads wait. With as many threads as there are cores the
others leave free, no region waits on a parked thread and the step degrades with the CPU it gets.

Checked every other step (two small reads of /proc, against a decode step of tens of milliseconds), on Linux
only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from moetier.portable import usable_cores

# forward steps between looks at the machine: a look costs ~0.1 ms (two /proc reads), a step tens of ms; with 8,
# the two looks that lower the threads came 9 steps late, and those steps ran at up to 1 s each beside a hog
CHECK_EVERY = 2


def runnable_elsewhere() -> int:
    """Threads of other processes that are running or waiting to run now: the kernel's count of runnable tasks
    (/proc/loadavg's 4th field) less this process's own threads in that state."""
    running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    mine = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        mine += stat[stat.rindex(")") + 2] == "R"
    return max(0, running - mine)


class CpuShare:
    """A step hook (Engine.step_hooks): every CHECK_EVERY forward steps, compute with as many threads as the cores
    other runnable threads leave (at least one, at most the threads it started with). Fewer threads once two looks
    in a row see the cores taken (on a quiet machine a lone look sometimes catches a passing kernel thread: TPOT's
    p90 rose 25% when one look sufficed), more at once."""

    def __init__(self, cores: int | None = None, elsewhere: Callable[[], int] = runnable_elsewhere,
                 set_threads: Callable[[int], None] = torch.set_num_threads, threads: int | None = None) -> None:
        self.cores = cores or usable_cores()
        self.full = threads or torch.get_num_threads()
        self.current = self.full
        self.elsewhere, self.set_threads = elsewhere, set_threads
        self.steps = 0
        self.was_fewer = False  # the last look also saw the cores taken (a lone look may catch a passing task)

    def __call__(self, batch=None, phase: int | None = None) -> None:
        self.steps += 1
        if self.steps % CHECK_EVERY != 1:
            return
        try:
            others = self.elsewhere()
        except (OSError, ValueError, IndexError):  # no /proc (not Linux): leave the threads as they are
            return
        want = max(1, min(self.full, self.cores - others))
        fewer = want < self.current
        if want > self.current or (fewer and self.was_fewer):  # fewer only when two looks in a row say so
            self.set_threads(want)
            self.current = want
        self.was_fewer = fewer

    def restore(self) -> None:
        if self.current != self.full:
            self.set_threads(self.full)
            self.current = self.full
