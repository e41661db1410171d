"""The layer step: the per-layer sequence of DESIGN.md's contract, written once. Both executors call it and
differ only in how they carry out a plan (the real one reads and computes, the simulated one advances a clock):

    plan = step.begin(route)      hooks hear the route; the policy hears it; the predictor observes it and
                                  names scores for the coming layers, which the policy hears too; the planner
                                  plans (pins, admits; a prefetch stage names reads for the coming layers)
    ...executor: issue the plan's loads, then its prefetches; compute what is resident while reads land, then
       the rest as each read lands...
    prefetches = step.end(plan)   the policy hears the accesses; what was read for the layer is resident; the
                                  layer's pins drop; hooks see the plan; the prefetcher names reads to start now

Observers (statistics, the trace recorder, evaluation) attach as a list of hooks.

DESIGN.md orders "predictor observes and predicts → prefetches are queued" after the layer's compute. We predict
at routing instead, as HOBBIT does (§3.1, step ②: the prediction is made with the current gate input, beside the
top-k selection): the routing and the router's input are all a predictor uses, and reads named then queue right
behind the layer's own on-demand loads, so the disk does not idle while the layer computes."""

from __future__ import annotations

from collections.abc import Callable

from moetier.cache.keys import ExpertKey
from moetier.cache.residency import IN_USE, Residency
from moetier.plan.layer_plan import RESIDENT, LayerPlan, Prefetch
from moetier.plan.planner import Planner
from moetier.plan.route import PREFILL, RouteResult
from moetier.predict.base import Predictor


class LayerHook:
    """An observer of layer steps; subclasses override what they need. One that hears routes alone (`needs_plans`
    False) lets a step whose every expert is resident skip planning beside it (engine/resident_layers.py tells it
    each route)."""

    needs_plans = True

    def on_route(self, route: RouteResult, gate_input) -> None:
        """Before planning: the layer's routing and the router's input (a tensor for the real executor, None
        for the simulated one)."""

    def on_plan(self, plan: LayerPlan, phase: int) -> None:
        """After the layer: its plan, carried out."""


def no_prefetch(plan: LayerPlan) -> list[Prefetch]:
    return []


class LayerStep:
    def __init__(self, residency: Residency, planner: Planner, hooks: list[LayerHook] | None = None,
                 prefetcher: Callable[[LayerPlan], list[Prefetch]] = no_prefetch,
                 predictor: Predictor | None = None) -> None:
        self.residency, self.policy, self.planner = residency, residency.policy, planner
        self.hooks = hooks if hooks is not None else []
        self.prefetcher = prefetcher
        self.predictor = predictor
        self.step = 0  # forward steps so far; routes are stamped with it
        self.phase = PREFILL

    def on_sequence_start(self) -> None:
        """A new sequence (a generate call, a trace's next prompt): the policy and the predictor reset."""
        self.policy.on_sequence_start()
        if self.predictor is not None:
            self.predictor.on_sequence_start()

    def begin_step(self, phase: int) -> None:
        """A forward step starts (its layers follow)."""
        self.step += 1
        self.phase = phase

    def begin(self, route: RouteResult, gate_input=None) -> LayerPlan:
        for hook in self.hooks:
            hook.on_route(route, gate_input)
        self.policy.on_route(route)
        predictions = {}
        if self.predictor is not None:
            self.predictor.observe(route.layer, gate_input, route)
            predictions = self.predictor.predict(route.layer, gate_input)
            self.policy.on_predict(predictions)
        return self.planner.plan(route, predictions)

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
