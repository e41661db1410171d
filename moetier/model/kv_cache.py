"""Preallocated KV cache: per layer [rows, kv_heads, max_len, head_dim] for keys and for values."""

from __future__ import annotations

import torch

from moetier.config import ModelSpec


class KVCache:
    def __init__(self, spec: ModelSpec, rows: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        shape = (rows, spec.num_kv_heads, max_len, spec.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.max_len = max_len

    def write(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, kv_heads, D] for tokens at (rows[i], positions[i])."""
        self.k[layer][rows, :, positions] = k
        self.v[layer][rows, :, positions] = v

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
