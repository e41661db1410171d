"""What both `--adapt` hooks (adapt_cache.py: the cache's size; adapt_variant.py: the library's variant) share: a look
at the memory at most every `look_s` seconds between forward steps, an indicator to smooth what they read from it
(CoMoE Eq. 10-12), and one line on stderr per decision.

Why a look and not every step: a look reads a few /proc and cgroup files (~0.1–0.2 ms), a demo model's decode step
takes ~10 ms."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from moetier.adapt.monitor import Indicator
from moetier.memory import MemoryView

LOOK_S = 0.25  # seconds between looks at the memory


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class MemoryLooks:
    def __init__(self, engine, memory: Callable[[], MemoryView], look_s: float = LOOK_S,
                 clock: Callable[[], float] = time.monotonic, say: Callable[[str], None] = to_stderr) -> None:
        self.engine, self.memory, self.look_s, self.clock, self.say = engine, memory, look_s, clock, say
        self.room = Indicator()
        self.last = float("-inf")

    def look(self) -> MemoryView | None:
        """The memory now, if a look is due; None between looks."""
        now = self.clock()
        if now - self.last < self.look_s:
            return None
        self.last = now
        return self.memory()
