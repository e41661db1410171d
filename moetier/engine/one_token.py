"""ExpertGroups' part for a plan of one token whose experts are all resident at one precision (LayerPlan.
one_token_order): the token through its experts in the kernel's one-token call, nothing grouped.

Why: at batch 1 grouping the pairs (a sort, an index_select of the row, the weights converted, the outputs'
buffer) and summing the outputs back (an index_add) are six small NumPy and torch ops with the caches cold from the
experts just streamed: ~85 us a layer on demo-deep on a Zen 4 (at 75% of its experts, where nearly every layer's
experts all hit, 4.18 → 3.15 ms a token; below the noise with real-size experts, demo-deep-xl). The kernels' `token`
sums the outputs as the combine does: the same output, bit for bit.
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
        self.ws = to_device(weights, x.device).to(weight_dtype)  # [k]
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
