"""Other processes' CPU while a benchmark runs: waited out before each run, measured during it, recorded beside its
numbers, and a run that met too much of it run again.

Why: on a 2-core machine one other process near a full core dropped llama.cpp's bf16 decode from ~15 to 2.4-5.9
tok/s while moetier's moved far less, and compare.py's bf16 summary said 1.84x on the strength of two such runs;
nothing in the JSON said so. Foreign CPU is the machine's busy time (/proc/stat: user, nice, system, irq, softirq,
steal) less what this process and the children it waited for used (getrusage), over the run's wall time, in cores.

    result = measured(lambda: run_child(...))   # result["load"]: foreign_cores, waited_s, reruns, under_load
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

THRESHOLD_CORES = 0.25  # foreign CPU, in cores averaged over a run, above which it is run again
IDLE_WAIT_S = 60.0  # at most this long waiting for an idle machine before a run (then it runs anyway, marked)
RERUNS = 2  # a run met too much foreign load: run again at most this many times; the last is kept, marked
TICK = os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """Seconds of CPU the whole machine has been busy since boot (all cores, /proc/stat's first line)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / TICK  # (guest time is within user already)


def own_s() -> float:
    """CPU this process and its waited-for children have used."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class LoadMeter:
    """`with LoadMeter() as m:` ... `m.foreign_cores`: the other processes' CPU over the block, in cores."""

    def __enter__(self) -> LoadMeter:
        self.start = (time.perf_counter(), machine_busy_s(), own_s())
        return self

    def __exit__(self, *exc) -> None:
        wall, busy, own = (b - a for a, b in zip(self.start, (time.perf_counter(), machine_busy_s(), own_s())))
        self.wall_s = wall
        self.foreign_cores = max(0.0, busy - own) / wall if wall > 0 else 0.0


def wait_for_idle(threshold: float = THRESHOLD_CORES, max_wait_s: float = IDLE_WAIT_S,
                  window_s: float = 1.0) -> tuple[float, float]:
    """Wait, `window_s` at a time, until the other processes' CPU falls to `threshold` cores or `max_wait_s`
    passes: (seconds waited, the last window's foreign cores)."""
    start = time.perf_counter()
    while True:
        with LoadMeter() as m:
            time.sleep(window_s)
        waited = time.perf_counter() - start
        if m.foreign_cores <= threshold or waited >= max_wait_s:
            return waited, m.foreign_cores


@dataclass(frozen=True)
class Load:
    """What the kept run met: foreign CPU during it, the wait before it, how many runs were made for it."""

    foreign_cores: float
    waited_s: float
    idle_before_cores: float  # the last idle window's foreign CPU, just before the run
    reruns: int
    under_load: bool  # kept although its foreign CPU passed the threshold (every rerun met it too)
    threshold_cores: float
    attempts_foreign_cores: tuple[float, ...]  # each run's, the kept one last


def measured(run: Callable[[], dict], threshold: float = THRESHOLD_CORES, reruns: int = RERUNS,
             max_wait_s: float = IDLE_WAIT_S, window_s: float = 1.0) -> dict:
    """`run()`'s result with a `load` entry (Load as a dict): the machine waited for first, the run measured, and
    run again (at most `reruns` times) while other processes took more than `threshold` cores during it."""
    seen: list[float] = []
    while True:
        waited, before = wait_for_idle(threshold, max_wait_s, window_s)
        with LoadMeter() as m:
            result = run()
        seen.append(m.foreign_cores)
        if m.foreign_cores <= threshold or len(seen) > reruns:
            break
    load = Load(seen[-1], waited, before, len(seen) - 1, seen[-1] > threshold, threshold, tuple(seen))
    return {**result, "load": asdict(load)}


def mark(runs: list[dict]) -> str:
    """'*' where any of `runs` was kept under foreign load (a table's flag), else ''."""
    return "*" if any(r.get("load", {}).get("under_load") for r in runs) else ""
