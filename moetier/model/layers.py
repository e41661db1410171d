"""Small building blocks, each written to match the reference implementation's arithmetic."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, cast back before the weight (as transformers does)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_fp32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the weight applied in fp32 and one cast at the end (gpt-oss)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def layer_weights(dense: dict[str, torch.Tensor], num_layers: int) -> list[dict[str, torch.Tensor]]:
    """Each layer's weights by short name (`layers.3.router` -> `router`), split once when a model is built rather
    than formatted in the hot loop."""
    return [{k.removeprefix(f"layers.{i}."): v for k, v in dense.items() if k.startswith(f"layers.{i}.")}
            for i in range(num_layers)]
