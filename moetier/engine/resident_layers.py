"""MoE layers when every expert is resident and nothing but the on-demand stage plans: each layer is computed
straight from the routing, with no plan.

Why: with the whole model in memory (`--expert-memory 100%`) the plan of every layer is the same — every expert a
resident run, no load, no eviction, no prefetch — yet making it (a LayerPlan, a Run and a pin per expert, the step's
end unpinning and checking reads) cost ~190 us a layer at batch 1 on OLMoE-1B-7B (Zen 4, int4: ~3 ms of a 31 ms
step), Python that the token's expert kernels then evict from the caches again. What is kept is what a plan of that
shape would change: the policy still hears the route and every access (DESIGN.md's contract), and the counters
count the same layer steps, needed experts and hits the counting hook would — all of a step's at its last MoE
layer, in their order (`_hear` says why). The experts are computed in the same
order by the same kernel call as a plan of resident runs does: the output is the same bit for bit.

The executor decides at each forward step whether this holds (moetier.engine.expert_executor)."""

from __future__ import annotations

import numpy as np
import torch

from moetier.cache.keys import ExpertKey
from moetier.engine.grouping import ExpertGroups
from moetier.engine.route_arrays import route_arrays, routes_arrays
from moetier.plan.route import RouteResult


class ResidentLayers:
    def __init__(self, executor) -> None:
        """Borrows `executor`'s resident slots (every expert at its one precision), kernel, policy and counters."""
        spec, residency = executor.spec, executor.residency
        if len(residency) < spec.num_expert_keys:
            raise ValueError("every expert must be resident")
        self.num_experts, self.precision = spec.num_experts, executor.precision
        self.index = {layer: i for i, layer in enumerate(spec.moe_layers)}
        pool = executor.pool
        self.weights: list[list[dict[str, torch.Tensor]]] = [[{}] * spec.num_experts for _ in spec.moe_layers]
        for key, entry in residency.entries.items():  # (slots never move while every expert stays resident)
            self.weights[self.index[key.layer]][key.expert] = pool.weights(entry.slot)
        for groups, ws in zip(spec.expert_groups, self.weights):  # a merged model's merged-away ids: their
            for e, principal in enumerate(groups):  # principal's weights, so a layer's table has a row for every
                ws[e] = ws[principal]  # id (the router never sends a token to them: MergedRouter)
        self.kernel = executor.expert_kernels[executor.precision]
        self.combine = executor.kernels.combine
        self.policy, self.counts = residency.policy, executor.counts
        self.hooks = executor.layer_step.hooks  # (live: the route listeners among them hear each route)
        self.keys = [[ExpertKey(layer, e) for e in range(spec.num_experts)] for layer in spec.moe_layers]
        # each layer's experts as the kernel's one native token call takes them (None: through `token`)
        tables = [self.kernel.token_table(ws) for ws in self.weights]
        self.tables = tables if all(t is not None for t in tables) else None
        # (the function, not a bound method: kept on its own object that would be a cycle, holding the cache's
        # views until Python's cycle collector next ran)
        self._one_token = ResidentLayers._token_routed if self.tables is not None else ResidentLayers._token
        # the most tokens computed straight from the router's outputs (a GPU's Triton tables take a small batch's)
        self.routed_tokens = self.kernel.routed_tokens if self.tables is not None else 1
        self.last = spec.moe_layers[-1]
        self.device = torch.device(executor.device)
        self.routes: list[tuple] = []  # this step's (layer, step, phase, scores, topk_ids, topk_weights), for `_hear`

    def __call__(self, layer: int, x: torch.Tensor, scores: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, shared, step: int, phase: int) -> torch.Tensor:
        """x [T, H], scores [T, E], topk_ids/topk_weights [T, k] -> routed (+ shared) expert output [T, H]."""
        out = self.compute(layer, x, scores, topk_ids, topk_weights, shared)
        self.heard(layer, scores, topk_ids, topk_weights, step, phase)
        return out

    def on_device(self, tokens: int) -> bool:
        """Whether `tokens` tokens' experts are computed from the router's outputs where they are, never read back
        to the host (`compute`): through the layers' tables (a GPU's: TritonExperts, up to `routed_tokens`), or one
        token on the CPU, where the routing is the host's own memory. What a captured CUDA graph needs
        (moetier/model/decode_graphs.py)."""
        return tokens <= self.routed_tokens and (self.tables is not None or self.device.type == "cpu")

    def compute(self, layer: int, x: torch.Tensor, scores: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, shared) -> torch.Tensor:
        """`__call__` without hearing the route: the caller tells it (`heard`) once the outputs are there."""
        index = self.index[layer]
        t = topk_ids.shape[0]
        if t == 1:  # one token (a decode step at batch 1): no grouping, the kernel sums its experts
            out = torch.empty_like(x)
            self._one_token(self, index, out, x, topk_ids, topk_weights)
        elif t <= self.routed_tokens and self.tables[index].takes(x, topk_ids, topk_weights):
            out = torch.empty_like(x)  # a few tokens the tables take: each one's experts summed, no grouping
            self.kernel.token_routed(out, x, topk_ids, topk_weights, self.tables[index])
        else:
            ids, weights, _ = route_arrays(topk_ids, topk_weights, scores)  # [T, k] (a host sync, as planning's)
            counts = np.bincount(ids.ravel(), minlength=self.num_experts)  # [E]
            experts = np.flatnonzero(counts)  # ascending
            groups = ExpertGroups(x, ids, weights, counts, topk_weights.dtype, self.combine)
            table = self.weights[index]
            groups.compute_layer(experts.tolist(), self.kernel, [table[e] for e in experts])
            out = groups.combine()
        return out + shared() if shared is not None else out

    def heard(self, layer: int, scores: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, step: int,
              phase: int) -> None:
        """A layer's route, computed here or by the model's one-call step (moetier/model/resident_step.py)."""
        self.routes.append((layer, step, phase, scores, topk_ids, topk_weights))
        if layer == self.last:
            self._hear()

    def _hear(self) -> None:
        """The policy hears each layer's route and accesses, and the counters count them, as a plan of resident runs
        would have — at the step's last MoE layer, for all of its layers in their order. Why not layer by layer:
        nothing is decided between (no read, no eviction: every expert stays), and the same few hundred bytecodes
        run sixteen times in a row warm instead of once a layer with the caches cold from the experts just streamed
        (~40 us a layer on OLMoE-1B-7B, Zen 4); on a GPU, the step's routes come back in one copy."""
        policy, precision = self.policy, self.precision
        arrays = routes_arrays([(topk_ids, topk_weights, scores) for *_, scores, topk_ids, topk_weights in self.routes])
        for (layer, step, phase, *_), host in zip(self.routes, arrays):
            # copies: the one-call step's buffers are written again next step
            ids, weights, probs = (a.copy() for a in host)  # [T, k], [T, k], [T, E]
            route = RouteResult(layer, step, ids, weights, probs, phase)
            policy.on_route(route)
            for hook in self.hooks:  # route listeners (no hook that needs plans is there: the executor checks)
                if hook is not self.counts:
                    hook.on_route(route, None)
            experts = np.unique(ids)  # ascending: a plan's order of resident runs
            keys = self.keys[self.index[layer]]
            for e in experts.tolist():
                policy.on_access(keys[e], precision, step)
            self.counts.phases[phase].add_hits(len(experts))  # what CountingHook adds for a plan of resident runs
        self.routes.clear()

    def _token(self, index: int, out: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> None:
        """Through the kernel's `token` on the slots' tensors, the experts in ascending ids with their weights in
        the router's dtype (as ExpertGroups weighs them)."""
        ids = topk_ids[0].cpu().numpy()
        order = np.argsort(ids, kind="stable")
        table = self.weights[index]
        self.kernel.token(out, x, topk_weights[0][torch.from_numpy(order).to(x.device)],
                          [table[e] for e in ids[order].tolist()], self.combine)

    def _token_routed(self, index: int, out: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> None:
        """From the layer's table and the router's outputs as they are (TokenTable.takes): the native call orders
        the experts and reads the weights as fp32, the values `token` reads (a bf16 weight's value exactly)."""
        table = self.tables[index]
        if not table.takes(x, topk_ids, topk_weights):
            return self._token(index, out, x, topk_ids, topk_weights)
        self.kernel.token_routed(out, x, topk_ids, topk_weights, table)
