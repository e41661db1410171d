"""Multi-head latent attention (DeepSeek-V2 §2.1; V3, Moonlight): each token's keys and values come from one
compressed latent c [kv_lora_rank] plus a rotary key k_pe [qk_rope_head_dim] shared by all heads, and the KV cache
holds exactly those two (kv_cache.py).

Attention runs on the latent itself: the per-head key up-projection W_UK is absorbed into the query
(q_nope · W_UK c = (W_UKᵀ q_nope) · c) and the value up-projection W_UV applied after the softmax, so a step reads
kv_lora_rank + qk_rope_head_dim numbers per cached token instead of expanding every cached token's keys and values
for every head (what transformers does). The same products summed in another order: fp32 logits agree within
1e-6 relative."""

from __future__ import annotations

import torch

from moetier.config import ModelSpec
from moetier.model.attention import prefill_attention
from moetier.model.batch import StepBatch
from moetier.model.kernels import TorchKernels
from moetier.model.kv_cache import KVCache
from moetier.model.rope import RopeTables, yarn_mscale

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm are built with the RMSNorm default, not rms_norm_eps


class LatentAttention:
    def __init__(self, spec: ModelSpec, layer: int, w: dict[str, torch.Tensor], kernels: TorchKernels) -> None:
        p, mla = f"layers.{layer}.", spec.latent_attention
        self.layer, self.spec, self.mla, self.kernels = layer, spec, mla, kernels
        self.q_proj = w.get(p + "q_proj")  # [H*(nope+rope), H] without q compression
        self.q_a_proj, self.q_a_bias = w.get(p + "q_a_proj"), w.get(p + "q_a_proj.bias")
        self.q_a_norm, self.q_b_proj = w.get(p + "q_a_norm"), w.get(p + "q_b_proj")
        self.kv_a_proj, self.kv_a_bias = w[p + "kv_a_proj"], w.get(p + "kv_a_proj.bias")  # [r + rope, H]
        self.kv_a_norm = w[p + "kv_a_norm"]
        kv_b = w[p + "kv_b_proj"].view(spec.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        self.w_uk = kv_b[:, :mla.qk_nope_head_dim]  # [H, nope, r] (views of the one weight)
        self.w_uv_t = kv_b[:, mla.qk_nope_head_dim:].transpose(1, 2)  # [H, r, v]
        self.o_proj, self.o_bias = w[p + "o_proj"], w.get(p + "o_proj.bias")
        self.scale = mla.qk_head_dim ** -0.5
        rope = spec.rope
        if rope.kind != "default" and rope.mscale_all_dim:  # YaRN's softmax correction (DeepSeek's own)
            self.scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2

    def __call__(self, x: torch.Tensor, batch: StepBatch, kv: KVCache, rope: RopeTables) -> torch.Tensor:
        mla, n, heads = self.mla, x.shape[0], self.spec.num_heads
        linear, norm = self.kernels.linear, self.kernels.rms_norm
        if self.q_proj is not None:
            q = linear(x, self.q_proj)
        else:
            q = linear(norm(linear(x, self.q_a_proj, self.q_a_bias), self.q_a_norm, LATENT_NORM_EPS), self.q_b_proj)
        q = q.view(n, heads, mla.qk_head_dim)
        q_nope, q_pe = q[..., :mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim:]
        compressed = linear(x, self.kv_a_proj, self.kv_a_bias)  # [N, r + rope]
        latent = norm(compressed[:, :mla.kv_lora_rank], self.kv_a_norm, LATENT_NORM_EPS)  # [N, r]
        k_pe = self.kernels.rope(rope, compressed[:, None, mla.kv_lora_rank:].contiguous(), batch)  # [N, 1, rope]
        q_pe = self.kernels.rope(rope, q_pe.contiguous(), batch)  # [N, H, rope]
        kv.write(self.layer, batch.rows, batch.positions, torch.cat((latent[:, None], k_pe), dim=-1))
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [N, H, r]
        q_full = torch.cat((q_latent, q_pe), dim=-1)  # [N, H, r + rope] against the cache's [latent, k_pe]
        keys, values = kv.k[self.layer], kv.v[self.layer]
        if batch.decode:
            out = self.kernels.decode_attention(q_full, keys, values, batch, None, self.scale)  # [N, H, r]
        else:
            out = prefill_attention(q_full, keys, values, batch, None, self.scale)
        out = torch.bmm(out.transpose(0, 1), self.w_uv_t).transpose(0, 1)  # [N, H, v]
        return linear(out.reshape(n, heads * mla.v_head_dim), self.o_proj, self.o_bias)
