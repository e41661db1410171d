"""Small building blocks, each written to match the reference implementation's arithmetic."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, cast back before the weight (as transformers does)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class Rope:
    """Rotary position embedding: cos/sin tables up to `max_len`, computed in fp32 and kept in the model dtype."""

    def __init__(self, head_dim: int, theta: float, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [S, D], computed on the CPU as the reference does
        self.cos, self.sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [N, heads, D], positions [N]."""
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # [N, 1, D]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
