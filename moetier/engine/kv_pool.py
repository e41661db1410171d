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
                 device: torch.device | str = "cpu", cache: KVCache | None = None) -> None:
        """`cache`: one made before (KeptCache's) of exactly `rows` rows and at least `max_len` positions (its own
        length the pool's); None: a new one."""
        if rows < 1 or max_len < 2:
            raise ValueError(f"a KV pool needs a row and two positions, got {rows} rows of {max_len}")
        if cache is not None and (cache.rows != rows or cache.max_len < max_len):
            raise ValueError(f"a KV cache of {cache.rows} rows of {cache.max_len} cannot hold {rows} of {max_len}")
        self.cache = cache if cache is not None else KVCache(spec, rows, max_len, dtype, device)
        self.rows, self.max_len = rows, self.cache.max_len
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


class KeptCache:
    """The KV cache of one `Engine.generate` call kept for the next (`--cuda-graphs`: a graph captured on a cache
    replays on it alone, and each call made its own, so each captured its graphs anew): `kept(rows, max_len)` hands
    it again where it has the call's rows and room for its length, else makes one of the length rounded up to a
    multiple of `step` (at most the context window: less than `step` positions more than asked) and keeps that
    instead. The memory of the last one stays taken between calls."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, step: int = 256) -> None:
        self.spec, self.dtype, self.device, self.step = spec, dtype, device, step
        self.cache: KVCache | None = None

    def __call__(self, rows: int, max_len: int) -> KVCache:
        cache = self.cache
        if cache is None or cache.rows != rows or cache.max_len < max_len:
            self.cache = None  # (the old one's memory back before the new one takes its own)
            length = max(min(-(-max_len // self.step) * self.step, self.spec.max_position_embeddings), max_len)
            cache = self.cache = KVCache(self.spec, rows, length, self.dtype, self.device)
        return cache

    def clear(self) -> None:
        self.cache = None


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
