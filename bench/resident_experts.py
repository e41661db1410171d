"""The compute-only bound: the same transformer with every expert already in memory and no cache machinery
(no planner, residency, policy or reader) — what decoding would cost if memory were not short."""

from __future__ import annotations

import numpy as np
import torch

from moetier.cache.policies.base import EvictionPolicy
from moetier.engine.expert_executor import ExpertExecutor
from moetier.engine.grouping import ExpertGroups


class ResidentExperts:
    def __init__(self, executor: ExpertExecutor) -> None:
        """Borrows the weights of a fully preloaded executor (no second copy in memory)."""
        spec, r = executor.spec, executor.residency
        if len(r) < spec.num_expert_keys:
            raise ValueError("preload every expert first (budget 100%)")
        self.weights = {key: executor.pool.weights(entry.slot) for key, entry in r.entries.items()}
        self.num_experts, self.kernel = spec.num_experts, executor.expert_kernels[executor.precision]
        self.policy = EvictionPolicy()

    def begin_step(self, phase, phases) -> None:
        pass

    def __call__(self, layer: int, x: torch.Tensor, scores, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 shared=None) -> torch.Tensor:
        ids = topk_ids.numpy()  # the one host sync of the layer, as in the engine
        counts = np.bincount(ids.ravel(), minlength=self.num_experts)
        groups = ExpertGroups(x, ids, topk_weights.float().numpy(), counts, topk_weights.dtype)
        for e in np.flatnonzero(counts).tolist():
            w = self.weights[(layer, e)]
            groups.compute(e, self.kernel, w)
        out = groups.combine()
        return out + shared() if shared is not None else out
