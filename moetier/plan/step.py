"""The layer step: the per-layer sequence of DESIGN.md's contract, written once. Both executors call it and
differ only in how they carry out a plan (the real one reads and computes, the simulated one advances a clock):

    plan = step.begin(route)      hooks hear the route; the policy hears it; the planner plans (pins, admits)
    ...executor: issue the plan's loads, then its prefetches; compute what is resident while reads land, then
       the rest as each read lands...
    prefetches = step.end(plan)   the policy hears the accesses; what was read for the layer is resident; the
                                  layer's pins drop; hooks see the plan; the prefetcher names reads to start now

Observers (statistics, the trace recorder, evaluation) attach as a list of hooks."""

from __future__ import annotations

from collections.abc import Callable

from moetier.cache.keys import ExpertKey
from moetier.cache.residency import IN_USE, Residency
from moetier.plan.layer_plan import RESIDENT, LayerPlan, Prefetch
from moetier.plan.planner import Planner
from moetier.plan.route import PREFILL, RouteResult


class LayerHook:
    """An observer of layer steps; subclasses override what they need."""

    def on_route(self, route: RouteResult, gate_input) -> None:
        """Before planning: the layer's routing and the router's input (a tensor for the real executor, None
        for the simulated one)."""

    def on_plan(self, plan: LayerPlan, phase: int) -> None:
        """After the layer: its plan, carried out."""


def no_prefetch(plan: LayerPlan) -> list[Prefetch]:
    return []


class LayerStep:
    def __init__(self, residency: Residency, planner: Planner, hooks: list[LayerHook] | None = None,
                 prefetcher: Callable[[LayerPlan], list[Prefetch]] = no_prefetch) -> None:
        self.residency, self.policy, self.planner = residency, residency.policy, planner
        self.hooks = hooks if hooks is not None else []
        self.prefetcher = prefetcher
        self.step = 0  # forward steps so far; routes are stamped with it
        self.phase = PREFILL

    def begin_step(self, phase: int) -> None:
        """A forward step starts (its layers follow)."""
        self.step += 1
        self.phase = phase

    def begin(self, route: RouteResult, gate_input=None) -> LayerPlan:
        for hook in self.hooks:
            hook.on_route(route, gate_input)
        self.policy.on_route(route)
        return self.planner.plan(route)

    def end(self, plan: LayerPlan) -> list[Prefetch]:
        """After the executor computed `plan`: returns the reads to start now."""
        layer, step = plan.layer, plan.route.step
        for e in plan.experts:  # ascending expert ids (recency ties between them break the same way everywhere)
            self.policy.on_access(ExpertKey(layer, e), plan.precision[e], step)
        for run in plan.runs:  # computed, so its read (this plan's or an earlier one's) has landed
            key = ExpertKey(layer, run.expert)
            if run.source != RESIDENT and self.residency.loading(key):  # (a streamed one has left again)
                self.residency.landed(key)
        self.residency.unpin_all(IN_USE)
        for hook in self.hooks:
            hook.on_plan(plan, self.phase)
        return self.prefetcher(plan)
