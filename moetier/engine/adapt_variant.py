"""`--adapt --variants FOLDER`: the variant of the model the memory allows (CoMoE Eq. 17, 34–35, Algorithm 7),
chosen while the engine runs and switched to between calls.

A step hook beside the cache's (moetier/engine/adapt_cache.py): at each look it takes the room the whole model could
have — what this process may still take plus what its dense weights and cache hold — smoothed (Eq. 10) and never
above the room now, less the dense weights (every variant's own), and computes Eq. 17's E'(t), the target number of
experts after aggregation: ⌊A_m·room/(S_e·(1 + β(1 − S_m)))⌋ within [1, E], S_e one expert's bytes in the cache, S_m
the memory's stability. Eq. 34 then picks the best quality among the library's variants of at most E'(t) experts
(a variant within it runs resident, without reads) — or, where none is, the one with the fewest (it runs
offloaded, the least pressed). It asks for a switch by Eq. 35: the quality gained (minus the perplexity change the
library measured) must exceed λ·C_switch, C_switch the seconds to read the new variant's cache at the link's
measured rate (λ = 0.01: one point of perplexity is worth a second of reads), and the new choice must have held for
`hold` looks; a variant over E'(t) is left at once. The switch itself happens at the start of the engine's next call
(Engine.use_variant: the dense weights, tokenizer and KV cache layout are the variants' own, so nothing but the
experts changes, and everything that holds them is made again) — between requests, not between the tokens of one:
a running call holds its model and executor, and a request is seconds, where the memory pressure this answers lasts
longer. Each request for a switch and each switch is one line on stderr."""

from __future__ import annotations

from pathlib import Path

from moetier.adapt.monitor import CacheSizing, Choice, Switching
from moetier.engine.memory_looks import MemoryLooks
from moetier.errors import MoetierError
from moetier.merge.library import Library, Variant

PER_SECOND = 0.01  # λ: quality (a perplexity share) a second of reading the new cache is worth
DEFAULT_READ_RATE = 1e9  # bytes/s until the link has been measured


class AdaptVariant(MemoryLooks):
    def __init__(self, engine, library: Library, memory, switching: Switching | None = None,
                 sizing: CacheSizing | None = None, **looks) -> None:
        """`sizing`: Eq. 17's A_m and β; `looks`: MemoryLooks' look_s, clock and say."""
        super().__init__(engine, memory, **looks)
        self.library, self.switching, self.sizing = library, switching or Switching(), sizing or CacheSizing()
        self.target: int | None = None  # E'(t) at the last look
        self.best: str | None = None
        self.stable_for = 0
        self.pending: Variant | None = None
        self.switches: list[tuple[str, str]] = []
        if self.current() is None:
            raise MoetierError(f"{engine.store.path} is not in the library {library.original}'s variants",
                               hint="start from the original or one of the variants library.json lists")

    def current(self) -> Variant | None:
        here = Path(self.engine.store.path).resolve()
        return next((v for v in self.library.variants if Path(v.path).resolve() == here), None)

    def choice(self, v: Variant) -> Choice:
        """A variant for Eq. 34: M_req its expert count (against E'(t)), P minus its measured perplexity change."""
        return Choice(v.name, sum(v.kept), -v.quality.get("perplexity_change", 0.0))

    def __call__(self, batch=None, phase: int | None = None) -> None:
        view = self.look()
        if view is None:
            return
        executor = self.engine.executor
        room_now = view.available + executor.reserved_bytes + self.engine.dense_bytes
        room = min(self.room.observe(room_now), room_now) - self.engine.dense_bytes  # the experts'
        slot = executor.residency.entry_bytes[executor.precision]  # S_e
        choices = {v.name: v for v in self.library.variants}
        most = max(sum(v.kept) for v in choices.values())  # E
        self.target = self.sizing.experts(room, slot, self.room.stability, most)  # E'(t)
        listed = [self.choice(v) for v in choices.values()]
        best = self.switching.best(listed, self.target) or min(listed, key=lambda c: (c.needed, -c.quality))
        self.stable_for = self.stable_for + 1 if best.name == self.best else 1
        self.best = best.name
        target = self.pending or self.current()
        if best.name == target.name:
            return
        rate = executor.costs.bandwidth or DEFAULT_READ_RATE
        cost = PER_SECOND * min(executor.reserved_bytes, choices[best.name].expert_bytes) / rate
        if self.switching.should_switch(self.choice(target), best, self.target, cost, self.stable_for):
            self.pending = choices[best.name]
            self.say(f"moetier: adapt: switch to {best.name} at the next request ({best.needed:.0f} experts, E'(t) "
                     f"{self.target}, Δ quality {best.quality - self.choice(target).quality:+.3f}): {view.describe()}")

    def apply(self) -> None:
        """Switch to the pending variant, if any (the engine calls this between calls). A switch that cannot be made
        (its store gone, its budget refused) is said and dropped: the call runs on the variant it had."""
        target, self.pending = self.pending, None
        if target is None:
            return
        before = self.current()
        try:
            choice = self.engine.use_variant(target.path)
        except MoetierError as e:
            self.say(f"moetier: adapt: stayed on {before.name}: {str(e).splitlines()[0]}")
            return
        self.switches.append((before.name, target.name))
        self.say(f"moetier: adapt: now running {target.name} ({choice.note.split(';')[0]})")
