"""Memory pressure in a replay (`moetier sim --pressure`): the expert budget changes before named steps, as the
engine's `--adapt` resizes its cache when the machine's free memory changes (CoMoE Eq. 19's m_avail moving), and
who leaves a shrinking cache is chosen by Eq. 18's offload priority or by the eviction policy (`--shrink`)."""

from __future__ import annotations

from dataclasses import dataclass

from moetier.errors import MoetierError
from moetier.sim.cost import CostModel
from moetier.sim.replay import SHRINKS, steps
from moetier.trace.format import Trace

HINT = "e.g. --pressure 100:10%,300:40% (before step 100 the cache shrinks to 10% of the experts; before 300 it " \
       "grows to 40%)"


@dataclass(frozen=True)
class Pressure:
    changes: tuple[tuple[int, str], ...]  # (step index, budget as --expert-memory takes it), steps ascending
    shrink: str = "offload-priority"  # who leaves a shrinking cache: one of SHRINKS

    def __post_init__(self) -> None:
        at = [step for step, _ in self.changes]
        if not at or at != sorted(set(at)) or at[0] < 0:
            raise MoetierError("--pressure needs its steps distinct, ascending and from 0", hint=HINT)
        if self.shrink not in SHRINKS:
            raise MoetierError(f"--shrink must be one of {', '.join(SHRINKS)}, got {self.shrink!r}")

    @classmethod
    def parse(cls, text: str, shrink: str = "offload-priority") -> Pressure:
        """`STEP:BUDGET[,STEP:BUDGET...]`; each budget is checked against the profile when resolved (slots)."""
        changes = []
        for item in text.split(","):
            step, sep, budget = item.strip().partition(":")
            if not sep or not step.strip().isdigit() or not budget.strip():
                raise MoetierError(f"--pressure item {item.strip()!r} is not STEP:BUDGET", hint=HINT)
            changes.append((int(step), budget.strip()))
        return cls(tuple(changes), shrink)

    def resizes(self, trace: Trace, cost: CostModel, budget_slots) -> dict[int, int]:
        """{step index: slots} for `trace` on `cost`'s profile (`budget_slots(budget, trace, cost)`, the sweep's own
        resolution of a budget); a step the trace never reaches is refused."""
        count = sum(1 for _ in steps(trace))
        late = [step for step, _ in self.changes if step >= count]
        if late:
            raise MoetierError(f"--pressure step {late[0]} is beyond the trace's {count} forward steps",
                               hint="steps count from 0: a prompt's prefill is one, each decoded token one")
        return {step: budget_slots(budget, trace, cost) for step, budget in self.changes}

    def row(self, resizes: dict[int, int]) -> dict:
        return {"pressure": [{"step": step, "expert_memory": budget, "slots": resizes[step]}
                             for step, budget in self.changes], "shrink": self.shrink}
