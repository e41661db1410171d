"""Routing as the reference does it: softmax over all experts in fp32, top-k, renormalise if the family does."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool,
          weights_in_fp32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] -> scores [T, E] fp32, topk_ids [T, k] int64, topk_weights [T, k].

    Mixtral keeps the top-k weights in fp32; the Qwen and OLMoE routers cast them to the model dtype."""
    logits = F.linear(x, router_weight)  # [T, E]
    scores = F.softmax(logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(scores, top_k, dim=-1)  # [T, k]
    if renormalize:
        topk_weights /= topk_weights.sum(dim=-1, keepdim=True)
    if not weights_in_fp32:
        topk_weights = topk_weights.to(logits.dtype)
    return scores, topk_ids, topk_weights
