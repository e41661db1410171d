"""Grouped-query attention with RoPE, optional q/k norms (per head or over all heads) and a sliding window."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetier.config import ModelSpec
from moetier.model.batch import StepBatch, causal_mask
from moetier.model.kernels import TorchKernels
from moetier.model.kv_cache import KVCache
from moetier.model.layers import Rope


class Attention:
    def __init__(self, spec: ModelSpec, layer: int, w: dict[str, torch.Tensor], kernels: TorchKernels) -> None:
        p = f"layers.{layer}."
        self.layer, self.spec, self.kernels = layer, spec, kernels
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (w[p + f"{n}_proj"] for n in "qkvo")
        self.q_bias, self.k_bias, self.v_bias, self.o_bias = (w.get(p + f"{n}_proj.bias") for n in "qkvo")
        self.q_norm, self.k_norm = w.get(p + "q_norm"), w.get(p + "k_norm")
        self.window = spec.sliding_window(layer)
        self.scale = spec.head_dim ** -0.5

    def __call__(self, x: torch.Tensor, batch: StepBatch, kv: KVCache, rope: Rope) -> torch.Tensor:
        spec, n = self.spec, x.shape[0]
        linear, norm = self.kernels.linear, self.kernels.rms_norm
        q = linear(x, self.q_proj, self.q_bias)  # [N, Hq*D]
        k = linear(x, self.k_proj, self.k_bias)  # [N, Hkv*D]
        v = linear(x, self.v_proj, self.v_bias)
        if spec.qk_norm == "full":  # OLMoE: one norm over all heads, before the split
            q, k = norm(q, self.q_norm, spec.rms_norm_eps), norm(k, self.k_norm, spec.rms_norm_eps)
        if spec.clip_qkv is not None:
            q, k, v = (t.clamp(-spec.clip_qkv, spec.clip_qkv) for t in (q, k, v))
        q = q.view(n, spec.num_heads, spec.head_dim)
        k = k.view(n, spec.num_kv_heads, spec.head_dim)
        v = v.view(n, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm == "head":  # Qwen3: per head, over head_dim
            q, k = norm(q, self.q_norm, spec.rms_norm_eps), norm(k, self.k_norm, spec.rms_norm_eps)
        q, k = self.kernels.rope(rope, q, batch), self.kernels.rope(rope, k, batch)
        kv.write(self.layer, batch.rows, batch.positions, k, v)
        if batch.decode:
            out = self.kernels.decode_attention(q, kv.k[self.layer], kv.v[self.layer], batch, self.window, self.scale)
        else:
            out = self._prefill(q, batch, kv)  # [N, Hq, D]
        return linear(out.reshape(n, -1), self.o_proj, self.o_bias)

    def _prefill(self, q: torch.Tensor, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        out = torch.empty_like(q)
        for row, first, start, length in batch.segments:
            qs = q[first:first + length].transpose(0, 1)[None]  # [1, Hq, t, D]
            keys = kv.k[self.layer][row:row + 1, :, :start + length]  # [1, Hkv, start+t, D]
            values = kv.v[self.layer][row:row + 1, :, :start + length]
            mask = causal_mask(start, length, self.window, q.device)
            o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, is_causal=mask is None,
                                               scale=self.scale, enable_gqa=True)
            out[first:first + length] = o[0].transpose(0, 1)
        return out
