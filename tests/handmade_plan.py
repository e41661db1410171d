"""A planner stage for tests that makes the plan every executor must be able to carry out: a substitute for a
routed expert, a skipped (token, k), and prefetches of later layers' experts."""

from __future__ import annotations

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.cache.residency import PREFETCHED, Residency
from moetier.plan.layer_plan import SKIP, LayerPlan, Prefetch


class Substitute:
    """Before on-demand: in layer `layer`, (token, k) pairs run another expert (`swap`) or nothing (`skip`)."""

    def __init__(self, layer: int, swap: dict[tuple[int, int], int], skip: list[tuple[int, int]]) -> None:
        self.layer, self.swap, self.skip = layer, swap, skip

    def __call__(self, plan: LayerPlan) -> LayerPlan:
        if plan.layer != self.layer:
            return plan
        ids = plan.assign_ids.copy()
        for (t, k), e in self.swap.items():
            ids[t, k] = e
        for t, k in self.skip:
            ids[t, k] = SKIP
        plan.reassign(ids, plan.assign_weights, next(iter(plan.precision.values())))
        return plan


class PrefetchAfter:
    """After on-demand: when layer `layer` is planned, prefetch `keys` (admitted as prefetched reads)."""

    def __init__(self, residency: Residency, layer: int, keys: list[ExpertKey], precision: str) -> None:
        self.residency, self.layer, self.keys, self.precision = residency, layer, keys, precision

    def __call__(self, plan: LayerPlan) -> LayerPlan:
        if plan.layer == self.layer:
            for key in self.keys:
                slot, evicted = self.residency.admit(key, self.precision, PREFETCHED)
                plan.prefetches.append(Prefetch(key, self.precision, slot, evicted))
        return plan


def direct(x, ids: np.ndarray, weights: np.ndarray, experts: dict[int, tuple]):
    """Sum over each token's (k, expert) pairs of weight * expert(x), written out with no plan."""
    import torch

    from moetier.model.kernels import TorchKernels

    swiglu = TorchKernels().swiglu
    out = torch.zeros_like(x)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            if ids[t, k] != SKIP:
                gate_up, down = experts[int(ids[t, k])]
                out[t] += float(weights[t, k]) * swiglu(x[t:t + 1], gate_up, down)[0]
    return out


def resident(*experts: int, layer: int = 0, capacity: int = 1000) -> Residency:
    """An LRU cache of bf16 experts (10 bytes each) holding `experts` of `layer`, landed and unpinned."""
    from moetier.cache.policies import LRUPolicy

    r = Residency(capacity, {"bf16": 10}, LRUPolicy())
    for e in experts:
        r.admit(ExpertKey(layer, e), "bf16")
        r.landed(ExpertKey(layer, e))
    r.unpin_all()
    return r
