"""`--adapt`: the expert cache follows the memory free beside it while the engine runs (CoMoE §III-A, Eq. 17).

A step hook (Engine.step_hooks): at most every `look_s` seconds, between forward steps, it reads what this process may
still take (host and cgroups: moetier/memory.py) plus what the cache holds — the room the cache could have — feeds
it to an indicator (EWMA and stability, moetier/adapt/monitor.py), and sizes the cache by Eq. 17 on the lower of the
smoothed room and the room now (a departure from the paper's smoothed value alone: memory another process has taken
is gone now, and a cache planned on an average that still remembers it — to shrink too late, or to grow back into
it — was killed in the pressure test). Smoothing and stability then only ever add caution: after a swing the
stability is low and Eq. 17 takes half or less of the room, and more as the memory holds steady.
The cache never grows past what the run asked for (`--expert-memory`, or the last `set_expert_memory`): adapting
gives way to other processes and takes back what it gave, it does not take more than it was given. Each change is
one line on stderr, and goes through the engine's resize (evicting by the policy, giving pages back, or adding
slots) — shrinking, the experts of lowest offload priority leave first (CoMoE Eq. 18, plan/offload_priority.py:
the least used and cheapest to bring back), where a miss's eviction stays the run's policy's. A change the budget
refuses is said and skipped."""

from __future__ import annotations

from moetier.adapt.monitor import CacheSizing
from moetier.config import MemoryBudget, format_bytes
from moetier.engine.memory_looks import MemoryLooks
from moetier.errors import BudgetError
from moetier.memory import MemoryView
from moetier.plan.offload_priority import OffloadPriority

GROW_MARGIN = 1.05  # grow only to a target this much above the cache now (a smoothed room wobbles)


class AdaptCache(MemoryLooks):
    def __init__(self, engine, memory, sizing: CacheSizing | None = None, **looks) -> None:
        """`looks`: MemoryLooks' look_s, clock and say."""
        super().__init__(engine, memory, **looks)
        self.sizing = sizing or CacheSizing()
        self.decisions: list[tuple[int, int]] = []  # (slots before, after) of each change made
        self.ceiling = engine.executor.slots  # what the run asked for: never grown past
        self._counted = None  # the executor the offload priority counts the activations of
        self.order: OffloadPriority | None = None
        self.offload_order()

    def offload_order(self) -> OffloadPriority:
        """Eq. 18's order for the engine's executor, counting its activations from the first look on (made again
        for a new executor: a switch of variant)."""
        executor = self.engine.executor
        if executor is not self._counted:
            spec, residency = self.engine.spec, executor.residency
            self.order = OffloadPriority(spec.moe_layers, spec.num_experts, lambda k: residency.entries[k].nbytes,
                                         lambda: executor.costs.bandwidth)
            executor.layer_step.hooks.append(self.order)
            self._counted = executor
        return self.order

    def __call__(self, batch=None, phase: int | None = None) -> None:
        order = self.offload_order()
        view = self.look()
        if view is None:
            return
        executor = self.engine.executor
        room_now = view.available + executor.reserved_bytes  # what the cache could take: free now and its own
        smoothed = self.room.observe(room_now)
        slot = executor.residency.entry_bytes[executor.precision]
        spec, current = self.engine.spec, executor.slots
        fit = self.sizing.experts(min(smoothed, room_now) - executor.tier_bytes, slot, self.room.stability,
                                  min(self.ceiling, spec.num_expert_keys), spec.top_k)
        target = fit if fit < current or fit >= current * GROW_MARGIN + 1 else current
        if target != current:
            self._resize(current, target, slot, view, smoothed, order)

    def _resize(self, current: int, target: int, slot: int, view: MemoryView, smoothed: float,
                order: OffloadPriority) -> None:
        executor = self.engine.executor
        try:
            self.engine.set_expert_memory(MemoryBudget("bytes", target * slot + executor.tier_bytes), asked=False,
                                          order=order)
        except BudgetError as e:
            self.say(f"moetier: adapt: kept the expert cache at {current} slots: {str(e).splitlines()[0]}")
            return
        after = executor.slots
        self.decisions.append((current, after))
        self.say(f"moetier: adapt: expert cache {current} -> {after} slots ({format_bytes(current * slot)} -> "
                 f"{format_bytes(after * slot)}): {view.describe()}; room for the cache {format_bytes(smoothed)} "
                 f"smoothed, stability {self.room.stability:.2f}")
