"""Grouped-query attention with RoPE (whole heads or their first dimensions), optional q/k norms (per head or over
all heads), biases and a sliding window; `SinkAttention` adds gpt-oss's learned per-head sink logit."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetier.config import ModelSpec
from moetier.model.batch import StepBatch, causal_mask
from moetier.model.kernels import TorchKernels
from moetier.model.kv_cache import KVCache
from moetier.model.rope import RopeTables
from moetier.model.stacked import STACKED


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: StepBatch,
                      window: int | None, scale: float) -> torch.Tensor:
    """q [N, Hq, D] of a prefill step against the layer's cache keys [R, Hkv, S, D], values [R, Hkv, S, Dv] (the
    step's own already written) -> [N, Hq, Dv], segment by segment."""
    out = q.new_empty(*q.shape[:2], values.shape[-1])
    for row, first, start, length in batch.segments:
        qs = q[first:first + length].transpose(0, 1)[None]  # [1, Hq, t, D]
        ks = keys[row:row + 1, :, :start + length]  # [1, Hkv, start+t, D]
        vs = values[row:row + 1, :, :start + length]
        mask = causal_mask(start, length, window, q.device)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=True)
        out[first:first + length] = o[0].transpose(0, 1)
    return out


class Attention:
    def __init__(self, spec: ModelSpec, layer: int, w: dict[str, torch.Tensor], kernels: TorchKernels) -> None:
        p = f"layers.{layer}."
        self.layer, self.spec, self.kernels = layer, spec, kernels
        self.o_proj, self.o_bias = w[p + "o_proj"], w.get(p + "o_proj.bias")
        self.qkv_proj = w.get(p + STACKED)  # the three stacked (moetier/model/stacked.py), or None
        if self.qkv_proj is not None:
            self.sizes = (spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim,
                          spec.num_kv_heads * spec.head_dim)
            if self.qkv_proj.shape[0] != sum(self.sizes):
                raise ValueError(f"layer {layer}'s stacked q/k/v has {self.qkv_proj.shape[0]} rows, not "
                                 f"{sum(self.sizes)}")
            self.qkv_bias = w.get(p + STACKED + ".bias")
            # the function, not `self._stacked`: a bound method kept on its own object is a cycle, which held a
            # dropped engine's weights until Python's cycle collector next ran
            self._project = Attention._stacked
        else:
            self.q_proj, self.k_proj, self.v_proj = (w[p + f"{n}_proj"] for n in "qkv")
            self.q_bias, self.k_bias, self.v_bias = (w.get(p + f"{n}_proj.bias") for n in "qkv")
            self._project = Attention._separate
        self.q_norm, self.k_norm = w.get(p + "q_norm"), w.get(p + "k_norm")
        self.window = spec.sliding_window(layer)
        self.scale = spec.head_dim ** -0.5

    def __call__(self, x: torch.Tensor, batch: StepBatch, kv: KVCache, rope: RopeTables) -> torch.Tensor:
        spec, n = self.spec, x.shape[0]
        linear, norm = self.kernels.linear, self.kernels.rms_norm
        q, k, v = self._project(self, x)  # [N, Hq*D], [N, Hkv*D], [N, Hkv*D]
        if spec.qk_norm == "full":  # OLMoE: one norm over all heads, before the split
            q, k = norm(q, self.q_norm, spec.rms_norm_eps), norm(k, self.k_norm, spec.rms_norm_eps)
        if spec.clip_qkv is not None:
            q, k, v = (t.clamp(-spec.clip_qkv, spec.clip_qkv) for t in (q, k, v))
        q = q.view(n, spec.num_heads, spec.head_dim)
        k = k.view(n, spec.num_kv_heads, spec.head_dim)
        v = v.view(n, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm == "head":  # Qwen3, GLM: per head, over head_dim
            q, k = norm(q, self.q_norm, spec.rms_norm_eps), norm(k, self.k_norm, spec.rms_norm_eps)
        q, k = self.kernels.rope(rope, q, batch), self.kernels.rope(rope, k, batch)
        self.kernels.kv_write(kv, self.layer, batch, k, v)
        out = self.attend(q, batch, kv)  # [N, Hq, D]
        return linear(out.reshape(n, -1), self.o_proj, self.o_bias)

    def _separate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        linear = self.kernels.linear
        return linear(x, self.q_proj, self.q_bias), linear(x, self.k_proj, self.k_bias), \
            linear(x, self.v_proj, self.v_bias)

    def _stacked(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One product; its columns split (each made contiguous: a no-op for one row, whose pieces already are)."""
        qkv = self.kernels.linear(x, self.qkv_proj, self.qkv_bias)  # [N, (Hq + 2 Hkv) * D]
        q, k, v = qkv.split(self.sizes, dim=-1)
        return q.contiguous(), k.contiguous(), v.contiguous()

    def attend(self, q: torch.Tensor, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        keys, values = kv.k[self.layer], kv.v[self.layer]
        if batch.decode:
            return self.kernels.decode_attention(q, keys, values, batch, self.window, self.scale)
        return prefill_attention(q, keys, values, batch, self.window, self.scale)


class SinkAttention(Attention):
    """gpt-oss: each head's softmax has one more logit, the learned sink, which takes probability and contributes
    no value. Written out (SDPA has no sinks) as the reference's eager attention computes it, in the model's dtype."""

    def __init__(self, spec: ModelSpec, layer: int, w: dict[str, torch.Tensor], kernels: TorchKernels) -> None:
        super().__init__(spec, layer, w, kernels)
        self.sinks = w[f"layers.{layer}.sinks"]  # [Hq]

    def attend(self, q: torch.Tensor, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        keys, values = kv.k[self.layer], kv.v[self.layer]
        if batch.decode:  # the kernels' where they have it (the native ones: a call a sequence), else written out
            out = self.kernels.sink_decode_attention(q, keys, values, batch, self.window, self.scale, self.sinks)
            if out is not None:
                return out
            s = batch.end
            ks, vs = keys[:, :, :s], values[:, :, :s]
            if not batch.all_rows:
                ks, vs = ks.index_select(0, batch.rows), vs.index_select(0, batch.rows)
            return self._softmax_attend(q[:, :, None, :], ks, vs, batch.decode_mask(self.window))[:, :, 0]
        out = torch.empty_like(q)
        for row, first, start, length in batch.segments:
            mask = causal_mask(start, length, self.window, q.device)
            if mask is None:
                mask = torch.ones(length, start + length, dtype=torch.bool, device=q.device).tril()
            qs = q[first:first + length].transpose(0, 1)[None]  # [1, Hq, t, D]
            o = self._softmax_attend(qs, keys[row:row + 1, :, :start + length], values[row:row + 1, :, :start + length],
                                     mask)
            out[first:first + length] = o[0].transpose(0, 1)
        return out

    def _softmax_attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        visible: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, t, D], keys/values [B, Hkv, S, D], visible [.., t, S] bool -> [B, Hq, t, D]. Query head h reads
        kv head h // (Hq / Hkv) (transformers' repeat_kv), here by grouping the queries instead of copying the cache."""
        b, hq, t, d = q.shape
        hkv, s = keys.shape[1], keys.shape[2]
        logits = (q.reshape(b, hkv, -1, d) @ keys.transpose(2, 3)).view(b, hq, t, s) * self.scale  # [B, Hq, t, S]
        logits = logits.masked_fill(~visible, torch.finfo(logits.dtype).min)
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, hq, t, 1)
        combined = torch.cat((logits, sinks), dim=-1)
        combined = combined - combined.amax(dim=-1, keepdim=True)
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]  # the sink's share is dropped
        out = probs.to(values.dtype).reshape(b, hkv, -1, s) @ values  # [B, Hkv, g·t, D]
        return out.view(b, hq, t, d)
