"""ExpertGroups' part for a plan of one token whose experts are all resident at one precision (LayerPlan.
one_token_order): the token through its experts in the kernel's one-token call, nothing grouped.

Why: at batch 1 grouping the pairs (a sort, an index_select of the row, the weights converted, the outputs'
buffer) and summing the outputs back (an index_add) are six small NumPy and torch ops with the caches cold from the
experts just streamed, and the kernels' `token` converts the row once and sums the outputs where they are made.
Measured with neighbouring decode steps alternated (bench/alternate_steps.py --feature one-token, 75% of the
experts, nearly every layer's all hit; Zen 4): demo-deep 3.96 → 2.71 ms a step, demo-deep-xl (real-size experts)
29.4 → 27.0 and 30.6 → 28.8 ms (1.06–1.09×). The same output, bit for bit. Where nothing but on-demand planning
runs (the default), such a layer is not even planned: HitLayer (moetier/engine/hit_layer.py) calls this directly;
a plan comes here where other stages plan (prefetching, substitution, a low tier).
ResidentLayers computes a step this way when every expert is resident; this is the same call for a planned layer
whose experts all hit."""

from __future__ import annotations

import numpy as np
import torch

from moetier.engine.grouping import to_device


class OneToken:
    def __init__(self, x: torch.Tensor, weights: np.ndarray, weight_dtype: torch.dtype, combine) -> None:
        """x [1, H]; `weights` [k] (host) the token's routing weights in ascending expert ids; weight_dtype: the
        router's (the reference weighs each expert's output in it); `combine`: the kernels'."""
        self.x = x
        self.ws, = to_device(x.device, torch.from_numpy(weights).to(weight_dtype))  # [k]
        self._combine = combine
        self.out = torch.empty_like(x)  # [1, H]

    def compute_layer(self, experts: list[int], kernel, ws: list[dict[str, torch.Tensor]]) -> None:
        """Every expert of the token at once (`ws` their slots' tensors, ascending ids): one `kernel.token` call."""
        if len(experts) != self.ws.shape[0]:
            raise ValueError(f"one call computes all {self.ws.shape[0]} of the token's experts, not {len(experts)}")
        kernel.token(self.out, self.x, self.ws, ws, self._combine)

    def combine(self) -> torch.Tensor:
        """The token's expert outputs summed: [1, H]."""
        return self.out
