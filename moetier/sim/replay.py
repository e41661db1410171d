"""Replays a trace through the very residency, planner and policy objects the engine runs, without tensors:
the hit/miss sequence the engine would produce on the same routing with the same budget and policy."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.base import EvictionPolicy
from moetier.cache.residency import Residency
from moetier.plan.layer_plan import LayerPlan
from moetier.plan.on_demand import OnDemandStage
from moetier.plan.planner import Planner
from moetier.plan.route import RouteResult
from moetier.trace.format import PREFILL, Trace


def steps(trace: Trace) -> Iterator[tuple[int, np.ndarray]]:
    """(phase, row indices) per forward step: a prompt's prefill rows together, each decode row alone
    (traces carry no batch boundaries, so decoding is replayed at batch 1)."""
    start, n = 0, trace.num_tokens
    while start < n:
        end = start + 1
        if trace.phase[start] == PREFILL:
            while end < n and trace.phase[end] == PREFILL and trace.seq[end] == trace.seq[start]:
                end += 1
        yield int(trace.phase[start]), np.arange(start, end)
        start = end


@dataclass
class ReplayResult:
    plans: list[LayerPlan] = field(default_factory=list)

    @property
    def needed(self) -> int:
        return sum(len(p.experts) for p in self.plans)

    @property
    def hits(self) -> int:
        return sum(len(p.hits) for p in self.plans)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.needed if self.needed else float("nan")

    def outcomes(self) -> list[tuple[int, list[int], list[int]]]:
        """(layer, hit experts, loaded experts) per layer step, in order: what the engine must match."""
        return [(p.layer, [h.expert for h in p.hits], [ld.expert for ld in p.loads]) for p in self.plans]


def topk_scores(topk_ids: np.ndarray, topk_weights: np.ndarray, num_experts: int) -> np.ndarray:
    """[T, E] scores holding each token's top-k weights and zeros elsewhere."""
    scores = np.zeros((len(topk_ids), num_experts), np.float32)
    np.put_along_axis(scores, topk_ids, topk_weights, axis=1)
    return scores


def replay(trace: Trace, policy: EvictionPolicy, num_slots: int,
           on_plan: Callable[[LayerPlan], None] | None = None, preload: bool = False,
           per_layer: bool = False) -> ReplayResult:
    """`preload` starts as Engine.preload() does: experts admitted layer by layer until the cache is full.
    `per_layer` splits the slots evenly among the trace's layers. A trace without full router scores hands
    the policies its top-k weights with zeros elsewhere."""
    residency = Residency(num_slots, policy, trace.layers if per_layer else None)
    if preload:
        for layer in trace.layers:
            for e in range(trace.num_experts):
                if residency.has_room(layer):
                    residency.admit(ExpertKey(layer, e))
        residency.unpin_all()
    planner = Planner(trace.num_experts, [OnDemandStage(residency)])
    result = ReplayResult()
    scores = trace.scores
    seq = None
    for step, (_, rows) in enumerate(steps(trace), start=1):
        if trace.seq[rows[0]] != seq:  # the engine starts a sequence with each generate call
            seq = trace.seq[rows[0]]
            policy.on_sequence_start()
        for j, layer in enumerate(trace.layers):
            ids = trace.topk_ids[rows, j].astype(np.int64)
            weights = trace.topk_weights[rows, j].astype(np.float32)
            route = RouteResult(layer, step, ids, weights, scores[rows, j].astype(np.float32)
                                if scores is not None else topk_scores(ids, weights, trace.num_experts))
            policy.on_route(route)
            plan = planner.plan(route)
            result.plans.append(plan)
            if on_plan is not None:
                on_plan(plan)
            for e in plan.experts:
                policy.on_access(ExpertKey(layer, e), "native", step)
            residency.unpin_all()
    return result
