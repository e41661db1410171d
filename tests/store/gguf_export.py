"""A Hugging Face checkpoint written as llama.cpp's converter writes it (convert_hf_to_gguf.py: each family's
keys, the converter's tensor names from the gguf package's TensorNameMap, experts stacked per layer as
blk.N.ffn_{gate,up,down}_exps, llama's Q/K rows permuted for its rotary layout, norms and routers in F32), for
tests that run one model from both. Checked against the real converter (llama.cpp 0.3.36's, --outtype f32) on
demo-deep and on tiny DeepSeek-V2, DeepSeek-V3 and GLM-4.5 folders: the same tensor names, shapes, types and bytes,
the same keys and values (docs/gguf.md) — DeepSeek's kv_b_proj split into attn_k_b (transposed) and attn_v_b, MLA
written as one wide key-value head, GLM's block_count counting its multi-token-prediction layer."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np

from moetier.model.families import family_for, parse_spec
from moetier.store.checkpoint import Checkpoint
from moetier.store.sources import expert_source
from tests.store import gguf_writer

ARCH = {"olmoe": "olmoe", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama",
        "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "glm4_moe": "glm4moe", "gpt_oss": "gpt-oss",
        "phimoe": "phimoe"}


def routed_keys(config: dict) -> dict:
    """DeepSeek's and GLM's expert keys, as DeepseekV2Model / Glm4MoeModel and TextModel write them."""
    out = {"expert_feed_forward_length": config["moe_intermediate_size"],
           "expert_shared_count": config.get("n_shared_experts") or 0,
           "leading_dense_block_count": config.get("first_k_dense_replace") or 0}
    if config.get("n_group"):
        out |= {"expert_group_count": config["n_group"], "expert_group_used_count": config["topk_group"]}
    if config.get("routed_scaling_factor") is not None:
        out["expert_weights_scale"] = float(config["routed_scaling_factor"])
    if config.get("norm_topk_prob"):
        out["expert_weights_norm"] = True
    return out


def deepseek2_keys(config: dict) -> dict:
    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    out = {"attention.head_count_kv": 1, "attention.kv_lora_rank": rank, "attention.key_length": rank + rope,
           "attention.value_length": rank, "attention.key_length_mla": config["qk_nope_head_dim"] + rope,
           "attention.value_length_mla": config["v_head_dim"], "rope.dimension_count": rope,
           "vocab_size": config["vocab_size"], **routed_keys(config)}
    if config.get("q_lora_rank"):
        out["attention.q_lora_rank"] = config["q_lora_rank"]
    if (yarn := yarn_keys(config)):
        p = config.get("rope_parameters") or config.get("rope_scaling")
        out |= {**yarn, "rope.scaling.yarn_log_multiplier": 0.1 * p["mscale_all_dim"]}
    return out


def glm4moe_keys(config: dict) -> dict:
    nextn = config.get("num_nextn_predict_layers") or 0
    partial = (config.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5)
    return {"block_count": config["num_hidden_layers"] + nextn, "nextn_predict_layers": nextn,
            "rope.dimension_count": int(config["head_dim"] * partial), "expert_gating_func": 2, **routed_keys(config)}


def yarn_keys(config: dict) -> dict:
    p = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if (p.get("rope_type") or p.get("type")) != "yarn":
        return {}
    return {"rope.scaling.type": "yarn", "rope.scaling.factor": float(p["factor"]),
            "rope.scaling.original_context_length": p["original_max_position_embeddings"],
            "rope.scaling.yarn_beta_fast": float(p["beta_fast"]), "rope.scaling.yarn_beta_slow": float(p["beta_slow"])}


def gpt_oss_keys(config: dict) -> dict:
    return {"attention.sliding_window": config["sliding_window"],
            "expert_feed_forward_length": config["intermediate_size"], **yarn_keys(config)}


def phimoe_keys(config: dict) -> dict:
    """Phi3MiniModel's: LongRoPE's one magnitude from the context lengths (not the config's mscales)."""
    p = config.get("rope_parameters") or config.get("rope_scaling")
    scale = config["max_position_embeddings"] / p["original_max_position_embeddings"]
    return {"rope.scaling.original_context_length": p["original_max_position_embeddings"],
            "rope.dimension_count": config["hidden_size"] // config["num_attention_heads"],
            "attention.sliding_window": config.get("sliding_window") or 0,
            "rope.scaling.attn_factor": math.sqrt(1 + math.log(scale) / math.log(p["original_max_position_embeddings"]))}


def phimoe_tensors(config: dict) -> dict:
    p = config.get("rope_parameters") or config.get("rope_scaling")
    return {f"rope_factors_{k}.weight": np.asarray(p[f"{k}_factor"], np.float32) for k in ("long", "short")}


def keys(config: dict, arch: str) -> dict:
    heads = config["num_attention_heads"]
    out = {"block_count": config["num_hidden_layers"], "context_length": config["max_position_embeddings"],
           "embedding_length": config["hidden_size"], "attention.head_count": heads,
           "attention.head_count_kv": config.get("num_key_value_heads", heads),
           "rope.freq_base": float(config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta")),
           # (llama.cpp's OlmoeModel writes OLMoE's 1e-5 whatever the config says: demo-deep's is 1e-6)
           "attention.layer_norm_rms_epsilon": 1e-5 if arch == "olmoe" else float(config["rms_norm_eps"]),
           "expert_count": config.get("num_experts") or config.get("n_routed_experts") or config["num_local_experts"],
           "expert_used_count": config["num_experts_per_tok"], "feed_forward_length": config["intermediate_size"]}
    if arch in ("qwen2moe", "qwen3moe"):
        out["expert_feed_forward_length"] = config["moe_intermediate_size"]
    if arch == "qwen2moe":
        out["expert_shared_feed_forward_length"] = config["shared_expert_intermediate_size"]
    if config.get("head_dim"):
        out["attention.key_length"] = out["attention.value_length"] = config["head_dim"]
    return out | {"deepseek2": deepseek2_keys, "glm4moe": glm4moe_keys, "gpt-oss": gpt_oss_keys,
                  "phimoe": phimoe_keys}.get(arch, lambda c: {})(config)


def split_kv_b(w: np.ndarray, config: dict, name: str) -> dict:
    heads, nope, v = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    kv_b = w.reshape(heads, nope + v, w.shape[-1])
    return {name.replace("attn_kv_b", "attn_k_b"): np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)),
            name.replace("attn_kv_b", "attn_v_b"): np.ascontiguousarray(kv_b[:, nope:])}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export(hf_dir: Path, out: Path, expert_types: dict | None = None, dense_type: str | None = None,
           tokenizer: dict | None = None, replace: dict | None = None, dense_types: dict | None = None) -> Path:
    """`expert_types`: {layer: (gate/up type, down type)} (None: every expert F32, or "bf16"); `dense_type`: the
    2-D dense matrices' (None: F32), `dense_types` {part of a name ("attn_v"): type} where they differ, as a
    Q4_K_M's attn_v is Q6_K; `replace`: {GGUF name: values} written F32 instead of the checkpoint's."""
    ckpt = Checkpoint(hf_dir)
    config = ckpt.config
    family, spec = family_for(config), parse_spec(config)
    arch = ARCH[config["model_type"]]
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     spec.num_layers)
    tensors = phimoe_tensors(config) if arch == "phimoe" else {}
    for theirs in family.dense_names(spec).values():
        w = ckpt.get(theirs).float().numpy()
        if arch == "llama" and theirs.endswith(("q_proj.weight", "k_proj.weight")):
            kv = "q_proj" not in theirs
            w = permute(w, config["num_key_value_heads"] if kv else config["num_attention_heads"])
        if theirs.endswith("kv_b_proj.weight"):  # DeepseekV2Model.modify_tensors: split, k_b transposed
            tensors.update(split_kv_b(w, config, names.get_name(theirs, try_suffixes=(".weight",))))
            continue
        theirs = theirs.removesuffix("_bias") + ".bias" if theirs.endswith("e_score_correction_bias") else theirs
        theirs = theirs + ".weight" if theirs.endswith("self_attn.sinks") else theirs  # GptOssModel.filter_tensors
        name = names.get_name(theirs, try_suffixes=(".weight", ".bias"))
        matrix = w.ndim == 2 and not name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))
        kind = next((t for part, t in (dense_types or {}).items() if part in name), dense_type)
        tensors[name] = (w, kind) if matrix and kind else w
    for layer in spec.moe_layers:
        source = expert_source(ckpt, family, spec, layer)
        experts = [source.get(e) for e in range(spec.num_experts)]
        i = spec.moe_intermediate_size
        stacked = {"gate": np.stack([x["gate_up_proj"][:i].float().numpy() for x in experts]),
                   "up": np.stack([x["gate_up_proj"][i:].float().numpy() for x in experts]),
                   "down": np.stack([x["down_proj"].float().numpy() for x in experts])}
        if "down_proj.bias" in experts[0]:  # gpt-oss: biases per expert, gate's and up's apart
            stacked_b = {"gate": [x["gate_up_proj.bias"][:i] for x in experts],
                         "up": [x["gate_up_proj.bias"][i:] for x in experts], "down": [x["down_proj.bias"] for x in experts]}
            tensors.update({f"blk.{layer}.ffn_{part}_exps.bias": np.stack([b.float().numpy() for b in bs])
                            for part, bs in stacked_b.items()})
        kinds = (expert_types or {}).get(layer, (None, None))
        for part, w in stacked.items():
            kind = kinds[1] if part == "down" else kinds[0]
            tensors[f"blk.{layer}.ffn_{part}_exps.weight"] = (w, kind) if kind else w
    tensors.update({name: np.asarray(v, np.float32) for name, v in (replace or {}).items()})
    meta = tokenizer or byte_tokenizer(spec.vocab_size, config.get("bos_token_id"), config.get("eos_token_id"))
    return gguf_writer.write(out, arch, keys(config, arch), tensors, meta)


def byte_tokenizer(vocab: int, bos: int | None, eos: int | None) -> dict:
    """`vocab` byte-level tokens without merges (a tiny model's: its ids are all the tests use)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = (alphabet + [f"[PAD{i}]" for i in range(len(alphabet), vocab)])[:vocab]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * vocab, "tokenizer.ggml.merges": ["a b"]}  # as bench/peers' conversion
    # gives a vocabulary without merges (llama.cpp's loader wants one)
    meta.update({f"tokenizer.ggml.{k}_token_id": v for k, v in (("bos", bos), ("eos", eos)) if v is not None})
    return meta
