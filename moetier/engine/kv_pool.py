"""KV-cache rows handed to requests: one preallocated cache of `rows` rows sized at start-up, a row taken when a
request's prefill runs and given back when it ends (its old keys are never read: attention sees a row only up to
its own length)."""

from __future__ import annotations

import heapq

import torch

from moetier.config import ModelSpec
from moetier.model.kv_cache import KVCache


class KVPool:
    def __init__(self, spec: ModelSpec, rows: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        if rows < 1 or max_len < 2:
            raise ValueError(f"a KV pool needs a row and two positions, got {rows} rows of {max_len}")
        self.cache = KVCache(spec, rows, max_len, dtype, device)
        self.rows, self.max_len = rows, max_len
        self._free = list(range(rows))  # a heap: the lowest free row first (a batch's prompts get 0, 1, ...)

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return heapq.heappop(self._free)

    def give(self, row: int) -> None:
        if row in self._free or not 0 <= row < self.rows:
            raise ValueError(f"KV row {row} is not in use")
        heapq.heappush(self._free, row)


def kv_bytes_per_token(spec: ModelSpec, dtype: torch.dtype) -> int:
    """What one position of one row costs across the layers (keys and values; a latent cache's one vector)."""
    size = torch.empty(0, dtype=dtype).element_size()
    mla = spec.latent_attention
    if mla is not None:
        return spec.num_layers * mla.cache_dim * size
    per_layer = 2 * spec.num_kv_heads * spec.head_dim * size
    s2s = spec.encoder_decoder
    layers = spec.num_layers if s2s is None else 2 * (spec.num_layers - s2s.encoder_layers)  # self + cross
    return layers * per_layer
