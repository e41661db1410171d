"""Tiny random checkpoints of every supported family, written by transformers itself (the reference)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

FAMILY_CONFIGS = {
    "mixtral": dict(num_local_experts=8, intermediate_size=48),
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                      intermediate_size=96, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=48, intermediate_size=96, norm_topk_prob=True),
    "olmoe": dict(num_experts=8, intermediate_size=48, norm_topk_prob=False),
    # a dense first layer, one shared expert, MLA with a compressed q (V3) and without (V2)
    "deepseek_v2": dict(n_routed_experts=8, moe_intermediate_size=48, intermediate_size=96, n_shared_experts=1,
                        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, topk_method="greedy", routed_scaling_factor=1.5,
                        num_key_value_heads=4),  # (MLA expands keys per head; transformers needs kv = q heads)
    "deepseek_v3": dict(n_routed_experts=8, moe_intermediate_size=48, intermediate_size=96, n_shared_experts=1,
                        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1, norm_topk_prob=True,
                        routed_scaling_factor=2.5, max_position_embeddings=256, num_key_value_heads=4,
                        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=64,
                                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8)),
    "glm4_moe": dict(n_routed_experts=8, moe_intermediate_size=48, intermediate_size=96, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True, head_dim=16,
                     partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True, routed_scaling_factor=1.0),
    # LayerNorm, biases everywhere, LongRoPE with its two scales (the long one beyond 32 positions)
    "phimoe": dict(num_local_experts=8, intermediate_size=48, attention_bias=True, lm_head_bias=True,
                   rope_scaling=dict(type="longrope", short_factor=[1.0 + i / 8 for i in range(8)],
                                     long_factor=[2.0 + i / 4 for i in range(8)], short_mscale=1.1, long_mscale=1.3,
                                     original_max_position_embeddings=32)),
    # sinks, alternating windows, YaRN, biased router and experts, clamped SwiGLU (a limit the tiny model reaches)
    "gpt_oss": dict(num_local_experts=8, intermediate_size=48, head_dim=16, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.3,
                    rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32,
                                      beta_fast=32.0, beta_slow=1.0, truncate=False)),
}
SEQ2SEQ_CONFIGS = {
    # 4 + 4 blocks, every other one sparse (blocks 1 and 3 of each stack), top-1 of 8 ReLU experts
    "switch_transformers": dict(d_model=64, d_kv=16, d_ff=96, num_layers=4, num_decoder_layers=4, num_heads=4,
                                num_experts=8, num_sparse_encoder_layers=2, num_sparse_decoder_layers=2,
                                vocab_size=128, expert_capacity=64, decoder_start_token_id=0, eos_token_id=1,
                                pad_token_id=0, relative_attention_num_buckets=8, relative_attention_max_distance=20),
}


def tiny_config(family: str, num_layers: int = 2, top_k: int = 2, **overrides):
    from transformers import AutoConfig

    if family in SEQ2SEQ_CONFIGS:
        return AutoConfig.for_model(family, **{**SEQ2SEQ_CONFIGS[family], **overrides})
    kw = dict(hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, num_experts_per_tok=top_k, max_position_embeddings=256, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    kw.update(FAMILY_CONFIGS[family])
    kw.update(overrides)
    return AutoConfig.for_model(family, **kw)


def build_tiny(family: str, out: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """Save a random checkpoint (fp32 unless `dtype` says) with `family`'s real transformers class; return the model
    (eval mode)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    torch.manual_seed(seed)
    auto = AutoModelForSeq2SeqLM if family in SEQ2SEQ_CONFIGS else AutoModelForCausalLM
    model = auto.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    with torch.no_grad():  # larger router weights make routing decisive, so near-ties do not decide tokens
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("gate.weight", "router.weight", "classifier.weight")) and p.dim() == 2 and p.shape[0] > 1:
                p.normal_(0, 0.5)
            if name.endswith("e_score_correction_bias"):  # zeros as initialised: give the bias something to do
                p.normal_(0, 0.3)
            elif name.endswith(("bias", "sinks")) and not p.any():  # likewise biases and attention sinks (small:
                p.normal_(0, 0.02)  # a tiny model's logits are, and a large head bias would decide every token)
    model = model.to(dtype).eval()
    model.save_pretrained(out)
    return model


def sparse_store(out: Path, intermediate_size: int, preset: str = "tiny") -> Path:
    """A store whose experts are `intermediate_size` wide, in sparse files: gigabytes of experts that take no disk.
    Good for what is decided before any expert is read (budgets); its expert bytes are zeros and fail checksums."""
    import dataclasses

    from moetier.store.format import ALIGN, BlobRef, Manifest, PrecisionLayout
    from moetier.store.synth import PRESETS, synthesize

    synthesize(PRESETS[preset], out, progress=False)
    m = Manifest.load(out)
    old = m.precisions[m.native_precision]
    layout = PrecisionLayout.swiglu(old.name, old.tensors[0].dtype, old.tensors[0].shape[1], intermediate_size)
    blobs, sizes = [], {}
    for b in m.blobs:
        offset = sizes.get(b.file, 0)
        blobs.append(BlobRef(b.layer, b.expert, b.precision, b.file, offset, layout.blob_bytes, 0))
        sizes[b.file] = offset + layout.blob_bytes
    for name, size in sizes.items():
        os.truncate(out / name, size)
    assert layout.blob_bytes % ALIGN == 0
    config = dict(m.config, intermediate_size=intermediate_size)
    dataclasses.replace(m, config=config, precisions={layout.name: layout}, blobs=tuple(blobs)).save(out)
    return out
