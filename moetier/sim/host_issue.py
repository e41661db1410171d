"""The host thread that issues a GPU's work, where it bounds a MoE layer (a profile's optional `host_issue`).

Why: below a whole-model budget the GPU engine reads each MoE layer's routing back to the host and plans there, so
the GPU waits for the host once a layer; on the 2026-11-30 H200 run that wait, not the link, set the step (docs/gpu.md:
16.1 ms a token with no loads, 41.8 with 68 loads, 45.0 with 100, 45.7 with 128 — the copies hidden under the host's
work until the link needs more than it). A profile without this part prices only the link and the kernels (a host
that keeps ahead of both).

The model, a MoE layer whose routing the host reads (any cache short of the whole model, or any mechanism beside the
on-demand plan — engine/resident_layers.py's condition):
- the host plans for `plan_s` after the routing is known, plus each mechanism's own work (`mechanism_s`, what it adds
  to on-demand LRU's layer: HOBBIT's precision plan, a prefetcher's stage, CoMoE's scores);
- then it queues the layer's loads, `load_s` each (the bookkeeping and the copy's CUDA calls): the i-th copy goes out
  no earlier than that, the link's own time after;
- `launch_s` more (grouping, the experts' and the next layer's launches) runs beside the copies;
- the host computes its own lane's experts (placement's HOST runs) in the same thread, after queueing;
- the layer ends when both the device's work and the host's are done.
A layer whose every expert is resident with nothing but the on-demand plan costs the host nothing here (the dense
part's measured time carries it).

Mechanism keys name what a configuration runs: `policy:<name>` (its eviction policy), `prefetch:<stage>`,
`predictor:<name>`, `precision:<mode>` (a mixed-precision mode), `substitution` (SMoE's) or `substitution:similar`
(CoMoE's), `placement:<name>`. A key the profile does not list costs nothing beyond on-demand LRU's layer."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

KEY = re.compile(r"(policy|prefetch|predictor|precision|placement):[a-z0-9_.-]+|substitution(:similar)?")


@dataclass(frozen=True)
class HostIssue:
    plan_s: float  # from the routing on the host to the first copy queued: the on-demand plan
    load_s: float  # queueing one load (on-demand or prefetch)
    launch_s: float  # the rest of a routed layer's host work, beside its copies
    mechanism_s: Mapping[str, float] = field(default_factory=dict, hash=False)  # what each adds to plan_s

    def __post_init__(self) -> None:
        if min(self.plan_s, self.load_s, self.launch_s) < 0:
            raise ValueError("host_issue: plan_s, load_s and launch_s must be >= 0")
        bad = [k for k in self.mechanism_s if not KEY.fullmatch(k)]
        if bad:
            raise ValueError(f"host_issue.mechanism_s: unknown key {', '.join(bad)} (policy:NAME, prefetch:STAGE, "
                             f"predictor:NAME, precision:MODE, placement:NAME, substitution, substitution:similar)")
        if any(v < 0 for v in self.mechanism_s.values()):
            raise ValueError("host_issue.mechanism_s: each must be >= 0")

    def planning_s(self, mechanisms: Iterable[str]) -> float:
        """The host's work from the routing to the first copy, for a configuration running `mechanisms`."""
        return self.plan_s + sum(self.mechanism_s.get(k, 0.0) for k in mechanisms)

    def scaled(self, factor: float) -> HostIssue:
        """Every figure times `factor` (a faster or slower host than the one measured)."""
        return HostIssue(self.plan_s * factor, self.load_s * factor, self.launch_s * factor,
                         {k: v * factor for k, v in self.mechanism_s.items()})

    def to_json(self) -> dict:
        return {"plan_s": self.plan_s, "load_s": self.load_s, "launch_s": self.launch_s,
                "mechanism_s": dict(self.mechanism_s)}


def mechanism_keys(policy: str, prefetch: str = "none", predictor: str | None = None, precision: str | None = None,
                   substitution: str | None = None, placement: str = "none") -> tuple[str, ...]:
    """A configuration's keys (this module's vocabulary). `precision`: a mixed-precision mode's name (None: one
    precision, planned by nothing); `substitution`: None, "smoe" or "similar"."""
    keys = [f"policy:{policy}"]
    if prefetch != "none":
        keys.append(f"prefetch:{prefetch}")
        if predictor:
            keys.append(f"predictor:{predictor}")
    if precision is not None:
        keys.append(f"precision:{precision}")
    if substitution is not None:
        keys.append("substitution" if substitution == "smoe" else "substitution:similar")
    if placement != "none":
        keys.append(f"placement:{placement}")
    return tuple(keys)


@dataclass(frozen=True)
class HostLane:
    """A simulation's host thread: the profile's figures and the configuration's planning time."""

    issue: HostIssue
    planning_s: float

    @classmethod
    def of(cls, issue: HostIssue, mechanisms: Iterable[str]) -> HostLane:
        return cls(issue, issue.planning_s(mechanisms))
