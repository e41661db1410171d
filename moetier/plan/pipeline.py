"""The planner's stages in their order, as both executors build them: substitution (SMoE, ours to enable), the
precision mode's (HOBBIT's loader, the low tier), on-demand, then a prefetch stage."""

from __future__ import annotations

from moetier.plan.costs import RunningCosts
from moetier.plan.precision import PrecisionSetup
from moetier.plan.prefetchers import layer_stages
from moetier.plan.substitute import Substitution


def plan_stages(made: PrecisionSetup, substitution: Substitution | None, prefetch: str, predictor, costs: RunningCosts,
                top_k: int, prefetch_params: dict | None = None) -> list:
    """`substitution`: resolved (its α known), or None for none (α 0 keeps the stage, which then changes nothing,
    for a run whose α is tuned as it goes)."""
    front = [substitution.stage(made.residency, made.high)] if substitution is not None else []
    return front + made.stages + layer_stages(made.residency, made.high, prefetch, predictor, costs, top_k,
                                              prefetch_params)
