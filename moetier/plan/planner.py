"""The per-layer planner: a pipeline of stages, each LayerPlan -> LayerPlan.

Exact mode runs only the on-demand stage. Later stages (substitution, precision choice, placement,
prefetch) slot in before or after it without touching the executor."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from moetier.plan.layer_plan import LayerPlan
from moetier.plan.route import RouteResult

Stage = Callable[[LayerPlan], LayerPlan]


class Planner:
    def __init__(self, num_experts: int, stages: Sequence[Stage]) -> None:
        self.num_experts = num_experts
        self.stages = tuple(stages)

    def plan(self, route: RouteResult) -> LayerPlan:
        plan = LayerPlan.from_route(route, self.num_experts)
        for stage in self.stages:
            plan = stage(plan)
        return plan
