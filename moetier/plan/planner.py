"""The per-layer planner: the exact plan of a route, then a pipeline of stages, each LayerPlan -> LayerPlan.

Exact mode runs only the on-demand stage. Later stages (substitution, precision choice, placement, prefetch)
slot in before or after it without touching the executors."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from moetier.cache.keys import Precision
from moetier.plan.layer_plan import LayerPlan
from moetier.plan.route import RouteResult

Stage = Callable[[LayerPlan], LayerPlan]


class Planner:
    def __init__(self, precision: Precision, stages: Sequence[Stage]) -> None:
        """`precision`: what an expert is wanted at unless a stage says otherwise (the model's own)."""
        self.precision = precision
        self.stages = list(stages)

    def plan(self, route: RouteResult, predictions: dict | None = None) -> LayerPlan:
        """`predictions`: the predictor's scores [T, E] for coming MoE layers, for the stages that prefetch."""
        plan = LayerPlan.exact(route, self.precision)
        plan.predictions = predictions or {}
        for stage in self.stages:
            plan = stage(plan)
        return plan
