"""Preallocated KV cache, per layer [rows, kv_heads, max_len, head_dim] for keys and for values.

Latent attention (DeepSeek's MLA) caches what its keys and values are made from instead: one tensor per layer
[rows, 1, max_len, kv_lora_rank + qk_rope_head_dim], each token's compressed latent then its rotary key, shared
by every head. `k` is that tensor, `v` its latent part (a view: nothing is stored twice).

An encoder-decoder (Switch) caches its decoder layers' keys and values (None for the encoder's layers), and for
each decoder layer the cross-attention keys and values of each row's encoded prompt, `encoder_lengths[row]` long."""

from __future__ import annotations

import torch

from moetier.config import ModelSpec


class KVCache:
    def __init__(self, spec: ModelSpec, rows: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        mla, s2s = spec.latent_attention, spec.encoder_decoder
        self.cross_k: list[torch.Tensor | None] = []
        self.cross_v: list[torch.Tensor | None] = []
        self.rows = rows
        self.encoder_lengths = [0] * rows
        if s2s is not None:
            shape = (rows, spec.num_kv_heads, max_len, spec.head_dim)

            def per_decoder_layer() -> list[torch.Tensor | None]:
                return [None if i < s2s.encoder_layers else torch.zeros(shape, dtype=dtype, device=device)
                        for i in range(spec.num_layers)]

            self.k, self.v, self.cross_k, self.cross_v = (per_decoder_layer() for _ in range(4))
        elif mla is not None:
            self.k = [torch.zeros((rows, 1, max_len, mla.cache_dim), dtype=dtype, device=device)
                      for _ in range(spec.num_layers)]
            self.v = [k[..., :mla.kv_lora_rank] for k in self.k]
        else:
            shape = (rows, spec.num_kv_heads, max_len, spec.head_dim)
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.latent = mla is not None
        self.max_len = max_len

    def write(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor | None = None) -> None:
        """k, v [N, kv_heads, D] for tokens at (rows[i], positions[i]); latent attention: k [N, 1, cache_dim]."""
        self.k[layer][rows, :, positions] = k
        if v is not None:
            self.v[layer][rows, :, positions] = v

    @property
    def nbytes(self) -> int:
        tensors = self.k if self.latent else self.k + self.v + self.cross_k + self.cross_v
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
