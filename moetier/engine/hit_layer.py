"""A layer whose tokens' experts are all resident, where nothing but the on-demand stage plans: computed
straight from its routing, with no plan — what ResidentLayers does for a whole step once every expert is resident,
for one layer of a smaller cache.

Why: the plan of such a layer changes nothing — every expert a resident run, no load, no eviction, no prefetch —
yet making it (a LayerPlan, a Run and a pin an expert, the step's end unpinning them and checking reads) costs tens
of microseconds of Python a layer at batch 1, with the caches cold from the experts just streamed. What is kept is
what the plan's steps would do (moetier/plan/step.py): every hook and the policy hear the route, the experts are
computed as a plan of resident runs would be (one token: the kernels' one-token call, OneToken; more, a server's
batch: the pairs grouped, ExpertGroups, each expert's rows in one layer call), the policy hears each access in
ascending ids, and the counters count the layer step, its needed experts and their hits as the counting
hook would. The executor uses it only where no hook needs the plan itself (a trace recorder does) and checks at
each step (ExpertExecutor.begin_step). Measured with neighbouring decode steps alternated (bench/alternate_steps.py
--feature hit-layer, 75% of the experts; Zen 4), against planning the layer and then the one-token call: demo-deep
3.15 → 2.26 ms a step, demo-deep-xl (real-size experts) 29.2 → 27.1 ms (1.03–1.06× in three runs)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from moetier.cache.keys import ExpertKey
from moetier.engine.grouping import ExpertGroups
from moetier.engine.one_token import OneToken
from moetier.plan.route import RouteResult


class HitLayer:
    def __init__(self, executor) -> None:
        """Borrows `executor`'s residency, its one precision's slots and kernel, its policy, hooks and counters."""
        spec = executor.spec
        self.residency, self.policy = executor.residency, executor.residency.policy
        self.precision = executor.precision
        self.pool, self.kernel = executor.pool, executor.expert_kernels[executor.precision]
        self.combine, self.costs, self.counts = executor.kernels.combine, executor.costs, executor.counts
        self.hooks = executor.layer_step.hooks  # (live)
        self.num_experts = spec.num_experts
        self.keys = {layer: [ExpertKey(layer, e) for e in range(spec.num_experts)] for layer in spec.moe_layers}

    def __call__(self, route: RouteResult, x: torch.Tensor, weight_dtype: torch.dtype,
                 shared: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
        """The layer's routed (+ shared) output [T, H] if its tokens' experts are all resident at the run's
        precision, else None (nothing heard, nothing computed: the layer is planned)."""
        ids = route.topk_ids  # [T, k]
        if ids.shape[0] == 1:
            order = np.argsort(ids[0], kind="stable")  # [k]
            experts = ids[0][order].tolist()  # ascending
        else:
            counts = np.bincount(ids.ravel(), minlength=self.num_experts)  # [E]
            experts = np.flatnonzero(counts).tolist()  # ascending
        keys, entries = self.keys[route.layer], self.residency.entries
        slots = []
        for e in experts:
            entry = entries.get(keys[e])
            if entry is None or entry.loading or entry.precision != self.precision:
                return None
            slots.append(entry.slot)
        for hook in self.hooks:  # as LayerStep.begin
            hook.on_route(route, x)
        self.policy.on_route(route)
        shared_out = shared() if shared is not None else None
        if ids.shape[0] == 1:  # (one token: the kernels' one-token call, nothing grouped)
            groups = OneToken(x, route.topk_weights[0][order], weight_dtype, self.combine)
        else:
            groups = ExpertGroups(x, ids, route.topk_weights, counts, weight_dtype, self.combine)
        start = time.perf_counter()
        groups.compute_layer(experts, self.kernel, [self.pool.weights(slot) for slot in slots])
        self.pool.queued()
        each = (time.perf_counter() - start) / len(experts)
        for _ in experts:  # (as ExpertExecutor._compute_together observes a layer's resident experts)
            self.costs.observe_expert(each)
        for e in experts:  # as LayerStep.end
            self.policy.on_access(keys[e], self.precision, route.step)
        self.counts.phases[route.phase].add_hits(len(experts))  # what CountingHook adds for a plan of resident runs
        out = groups.combine()
        return out + shared_out if shared_out is not None else out
