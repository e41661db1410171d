"""(token, expert) pairs grouped by expert: ascending expert ids, tokens ascending within each, so every token
accumulates its experts' outputs in the order the reference does (bit-for-bit in fp32)."""

from __future__ import annotations

import numpy as np
import torch

from moetier.model.layers import swiglu


class ExpertGroups:
    def __init__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, counts: np.ndarray) -> None:
        self.x = x
        order = torch.argsort(topk_ids.view(-1), stable=True)  # [T*k]
        self.token_of = order // topk_ids.shape[1]  # [T*k]
        self.xs = x.index_select(0, self.token_of)  # [T*k, H]
        self.ws = topk_weights.reshape(-1)[order]  # [T*k]
        self.ys = torch.empty_like(self.xs)
        self.offsets = np.concatenate(([0], np.cumsum(counts))).tolist()

    def compute(self, expert: int, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
        a, b = self.offsets[expert], self.offsets[expert + 1]
        self.ys[a:b] = swiglu(self.xs[a:b], gate_up_proj, down_proj) * self.ws[a:b, None]

    def combine(self) -> torch.Tensor:
        """Sum each token's expert outputs: [T, H]."""
        return torch.zeros_like(self.x).index_add_(0, self.token_of, self.ys)
