"""A GGUF file (or a split set, `NAME-00001-of-0000N.gguf`) as a model: read with llama.cpp's own reader (the
`gguf` package), its metadata mapped onto the Hugging Face config a family parses, its tensors found by the names
llama.cpp's converter gave them (the `gguf` package's TensorNameMap, the converter's own table), each tensor's type,
shape and place in its file, and its tokenizer built from `tokenizer.ggml.*` with the `tokenizers` library.

Which architectures: llama.cpp's arch names mapped to the families moetier runs (`ARCHES`); any other is refused
with its name. What the converter changed in the weights is undone where they are read: llama-arch Q/K rows
permuted for its rotary layout (Mixtral: `unpermute`), DeepSeek's kv_b_proj split into attn_k_b (transposed) and
attn_v_b (gguf_store.GgufCheckpoint joins them), GLM's multi-token-prediction layers counted in block_count,
gpt-oss's sinks named `.weight` (its gate and up the converter writes apart, as the store keeps them). What a file
does not keep is taken as llama.cpp's graph fixes it (each arch's function says what). Errors are one line
(GgufError) before anything is written."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moetier.errors import CheckpointError

SPLIT = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
KNOWN_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "Q8_0": "q8_0", "Q4_K": "q4_k",
               "Q5_K": "q5_k", "Q6_K": "q6_k", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0",
               "Q5_1": "q5_1", "MXFP4": "mxfp4"}  # GGML type -> moetier's name for it: read and computed as they are
# Types no kernel of ours computes, which the gguf package's dequantizers read (gguf.quants): a dense tensor's
# values are read once at indexing, experts are dequantized into the store's own copies, each with a note
DEQUANTIZED_TYPES = ("Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL",
                     "IQ4_XS", "TQ1_0", "TQ2_0", "NVFP4")
HINT = "give a GGUF file as llama.cpp's convert_hf_to_gguf.py and llama-quantize write them"


class GgufError(CheckpointError):
    pass


@dataclass(frozen=True)
class Tensor:
    """One tensor of the file: `shape` in torch's order (rows first: ggml's ne reversed), its GGML type's name,
    `nbytes` at `offset` in `path`."""

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    path: Path
    offset: int
    nbytes: int
    data: np.ndarray  # the reader's memory map: uint8 blocks for block types, the values for float ones

    @property
    def type(self) -> str | None:
        """moetier's name for its type (None: one no kernel of ours reads: dequantized, or refused)."""
        return KNOWN_TYPES.get(self.ggml_type)

    @property
    def readable(self) -> bool:
        return self.type is not None or self.ggml_type in DEQUANTIZED_TYPES


def split_parts(path: Path) -> list[Path]:
    """Every file of a split set named by its first (or any) part, in order; one file otherwise."""
    m = SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise GgufError(f"{path.name} is part of a split set of {count} files; missing: {', '.join(missing)}",
                        hint="keep every part of the set in one folder")
    return parts


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:  # a short or foreign file: the reader's own words
        raise GgufError(f"{path} is not a readable GGUF file ({str(e).splitlines()[0][:160]})", hint=HINT) from None


class GgufModel:
    """A GGUF model's metadata, tensors and tokenizer (nothing read but its headers until a tensor is asked for)."""

    def __init__(self, path: Path | str) -> None:
        path = Path(path)
        if not path.is_file():
            raise GgufError(f"no GGUF file at {path}", hint=HINT)
        self.path = path
        self.parts = split_parts(path)
        readers = [_reader(p) for p in self.parts]
        self.metadata = _metadata(readers[0])
        self.arch = str(self.metadata.get("general.architecture", ""))
        self.tensors: dict[str, Tensor] = {}
        for part, reader in zip(self.parts, readers):
            for t in reader.tensors:
                self.tensors[t.name] = Tensor(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                                              part, int(t.data_offset), int(t.n_bytes), t.data)
        self.arch_spec = arch_spec(self.arch, self.metadata)
        unknown = sorted({t.ggml_type for t in self.tensors.values() if not t.readable})
        if unknown:
            names = [t.name for t in self.tensors.values() if not t.readable]
            raise GgufError(f"{path.name} has tensors of GGML types moetier does not read: {', '.join(unknown)} "
                            f"({len(names)} tensors, e.g. {names[0]})",
                            hint=f"moetier reads {', '.join([*KNOWN_TYPES, *DEQUANTIZED_TYPES])}; requantize with "
                                 f"llama-quantize")

    def key(self, name: str, default=None):
        """A metadata value under the arch's prefix (`{arch}.name`)."""
        return self.metadata.get(f"{self.arch}.{name}", default)

    def config(self) -> dict:
        """The Hugging Face config.json the metadata stands for (what the family parses)."""
        return {"model_type": self.arch_spec.model_type, **_common(self), **self.arch_spec.fields(self)}

    def tensor(self, name: str) -> Tensor:
        if name not in self.tensors:
            raise GgufError(f"{self.path.name} has no tensor {name!r}, which its {self.arch} model needs", hint=HINT)
        return self.tensors[name]


def _metadata(reader) -> dict:
    """Every key's value as Python (arrays of strings and numbers as lists); the reader's contents()."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except (ValueError, IndexError) as e:
            raise GgufError(f"metadata {key!r} cannot be read ({e})", hint=HINT) from None
    return out


@dataclass(frozen=True)
class ArchSpec:
    """How one llama.cpp architecture maps onto families: the model_types it stands for (the first unless its
    fields say another: deepseek2 is V2 or V3 by its gating function) and the config fields its own."""

    model_types: tuple[str, ...]
    fields: Callable[[GgufModel], dict]
    permute_qk: bool = False  # the converter permuted Q/K rows (llama arch): undone when read

    def __post_init__(self):
        if not self.model_types:
            raise ValueError("an ArchSpec stands for at least one model_type")

    @property
    def model_type(self) -> str:
        return self.model_types[0]


def decimal(value) -> float:
    """A float32 the converter wrote from a config's decimal (1e-05), as that decimal: the shortest one the float32
    rounds from, so the model computes with the config's value, as from the Hugging Face folder."""
    return float(repr(np.float32(value)).removeprefix("np.float32(").removesuffix(")"))


def _common(m: GgufModel) -> dict:
    heads = int(m.key("attention.head_count", 0))
    tokens = m.metadata.get("tokenizer.ggml.tokens") or []
    embed = m.tensors.get("token_embd.weight")
    cfg = {
        "hidden_size": int(m.key("embedding_length", 0)),
        "num_hidden_layers": int(m.key("block_count", 0)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m.key("attention.head_count_kv", heads)),
        "rms_norm_eps": decimal(m.key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": decimal(m.key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(m.key("context_length", 0)),
        "num_experts_per_tok": int(m.key("expert_used_count", 0)),
        "vocab_size": embed.shape[0] if embed is not None else len(tokens),
        "tie_word_embeddings": "output.weight" not in m.tensors,
        "hidden_act": "silu",
        "dtype": "bfloat16",
    }
    if m.key("attention.key_length") is not None:
        cfg["head_dim"] = int(m.key("attention.key_length"))
    for ours, theirs in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                         ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if theirs in m.metadata:
            cfg[ours] = int(m.metadata[theirs])
    return cfg


def _olmoe(m: GgufModel) -> dict:  # llama.cpp's graph: softmax top-k, never renormalised
    return {"num_experts": int(m.key("expert_count")), "intermediate_size": int(m.key("feed_forward_length")),
            "norm_topk_prob": False}


def _qwen2moe(m: GgufModel) -> dict:
    return {"num_experts": int(m.key("expert_count")),
            "moe_intermediate_size": int(m.key("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(m.key("expert_shared_feed_forward_length")),
            "intermediate_size": int(m.key("feed_forward_length", 0)), "norm_topk_prob": False}


def _qwen3moe(m: GgufModel) -> dict:  # llama.cpp's qwen3moe graph renormalises the top-k weights
    return {"num_experts": int(m.key("expert_count")),
            "moe_intermediate_size": int(m.key("expert_feed_forward_length")),
            "intermediate_size": int(m.key("feed_forward_length", 0)), "norm_topk_prob": True}


def _mixtral(m: GgufModel) -> dict:
    return {"num_local_experts": int(m.key("expert_count")), "intermediate_size": int(m.key("feed_forward_length"))}


GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax; absent: softmax, as V2's files)


def _routed(m: GgufModel) -> dict:
    """DeepSeek's and GLM's expert fields (the dense first layers, the shared experts, the router's scale)."""
    return {"n_routed_experts": int(m.key("expert_count")),
            "moe_intermediate_size": int(m.key("expert_feed_forward_length")),
            "intermediate_size": int(m.key("feed_forward_length", 0)),
            "n_shared_experts": int(m.key("expert_shared_count", 0)),
            "first_k_dense_replace": int(m.key("leading_dense_block_count", 0)),
            "routed_scaling_factor": decimal(m.key("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(m.key("expert_weights_norm", False)),
            "n_group": int(m.key("expert_group_count", 1)), "topk_group": int(m.key("expert_group_used_count", 1))}


def _yarn(m: GgufModel) -> dict:
    """rope_parameters for a file's YaRN keys ({} without). A file with yarn_log_multiplier (DeepSeek's) keeps
    0.1·mscale_all_dim there and not mscale, which llama.cpp takes as equal (its deepseek2 graph cancels the rotary
    magnitude): so do we — the same as transformers for every DeepSeek release, whose two are equal. Without it the
    magnitude is YaRN's default, 0.1·ln(factor) + 1, in both."""
    if m.key("rope.scaling.type") != "yarn":
        return {}
    out = {"rope_type": "yarn", "rope_theta": decimal(m.key("rope.freq_base", 10000.0)),
           "factor": decimal(m.key("rope.scaling.factor")),
           "original_max_position_embeddings": int(m.key("rope.scaling.original_context_length")),
           "beta_fast": decimal(m.key("rope.scaling.yarn_beta_fast", 32.0)),
           "beta_slow": decimal(m.key("rope.scaling.yarn_beta_slow", 1.0))}
    if m.key("rope.scaling.yarn_log_multiplier") is not None:
        mscale = decimal(float(m.key("rope.scaling.yarn_log_multiplier")) / 0.1)
        out |= {"mscale": mscale, "mscale_all_dim": mscale}
    return out


def _deepseek2(m: GgufModel) -> dict:
    """V3 (and Moonlight, Kimi) where the router is sigmoid with a correction bias; V2 otherwise. The converter
    writes MLA as multi-query attention with the latent as one wide head (head_count_kv 1, key_length
    kv_lora_rank + rope); the per-head sizes are the *_mla keys (older files: key_length and value_length)."""
    rope = int(m.key("rope.dimension_count"))
    qk = int(m.key("attention.key_length_mla", m.key("attention.key_length")))
    v3 = int(m.key("expert_gating_func", 0)) == GATING_SIGMOID or any(n.endswith("exp_probs_b.bias") for n in m.tensors)
    q_lora = m.key("attention.q_lora_rank")
    cfg = {**_routed(m), "model_type": "deepseek_v3" if v3 else "deepseek_v2",
           "num_key_value_heads": int(m.key("attention.head_count")), "kv_lora_rank": int(m.key("attention.kv_lora_rank")),
           "q_lora_rank": None if q_lora is None else int(q_lora), "qk_rope_head_dim": rope, "qk_nope_head_dim": qk - rope,
           "v_head_dim": int(m.key("attention.value_length_mla", m.key("attention.value_length"))), "head_dim": rope}
    if not v3:  # transformers' V2 router: greedy, or the best max-score groups where the model has groups
        cfg["topk_method"] = "group_limited_greedy" if cfg["n_group"] > 1 else "greedy"
    if (yarn := _yarn(m)):
        cfg["rope_parameters"] = yarn
    return cfg


def _glm4moe(m: GgufModel) -> dict:
    """GLM-4.5: block_count counts the multi-token-prediction layers (nextn_predict_layers) after the model's."""
    head_dim = int(m.key("attention.key_length"))
    return {**_routed(m), "num_hidden_layers": int(m.key("block_count")) - int(m.key("nextn_predict_layers", 0)),
            "partial_rotary_factor": int(m.key("rope.dimension_count", head_dim)) / head_dim,
            "use_qk_norm": "blk.0.attn_q_norm.weight" in m.tensors, "attention_bias": "blk.0.attn_q.bias" in m.tensors}


def _gpt_oss(m: GgufModel) -> dict:
    """gpt-oss: what the file does not say, as llama.cpp's gpt-oss graph fixes it and the released models have it —
    sliding and full layers alternating from a sliding one (its swa pattern 2), SwiGLU clamped at 7, and YaRN
    without truncating its correction range (the released config's `truncate: false`)."""
    layers, window = int(m.key("block_count")), m.key("attention.sliding_window")
    cfg = {"num_local_experts": int(m.key("expert_count")),
           "intermediate_size": int(m.key("expert_feed_forward_length")), "swiglu_limit": 7.0,
           "attention_bias": "blk.0.attn_q.bias" in m.tensors,
           "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]}
    if window:
        cfg["sliding_window"] = int(window)
    if (yarn := _yarn(m)):
        cfg["rope_parameters"] = {**yarn, "truncate": False}
    return cfg


def _phimoe(m: GgufModel) -> dict:
    """Phi-3.5-MoE. The file keeps LongRoPE's factors as tensors and one magnitude (rope.scaling.attn_factor, which
    the converter computes as sqrt(1 + ln(factor)/ln(original)) whatever short_mscale and long_mscale the config
    gave): both scales are that one, as llama.cpp computes it. Sparsemixer's jitter is the released 0.01 (the
    file keeps none)."""
    window = int(m.key("attention.sliding_window", 0))  # (0: none, as the converter writes a None)
    cfg = {"num_local_experts": int(m.key("expert_count")), "intermediate_size": int(m.key("feed_forward_length")),
           "attention_bias": "blk.0.attn_q.bias" in m.tensors, "lm_head_bias": "output.bias" in m.tensors,
           "router_jitter_noise": 0.01, "sliding_window": window or None}
    if "rope_factors_long.weight" in m.tensors:
        factors = {f"{k}_factor": [decimal(v) for v in np.asarray(m.tensor(f"rope_factors_{k}.weight").data, np.float32)]
                   for k in ("long", "short")}
        scale = decimal(m.key("rope.scaling.attn_factor", 1.0))
        cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": decimal(m.key("rope.freq_base", 10000.0)),
                                  "original_max_position_embeddings": int(m.key("rope.scaling.original_context_length")),
                                  "short_mscale": scale, "long_mscale": scale, **factors}
    return cfg


ARCHES = {
    "olmoe": ArchSpec(("olmoe",), _olmoe),
    "qwen2moe": ArchSpec(("qwen2_moe",), _qwen2moe),
    "qwen3moe": ArchSpec(("qwen3_moe",), _qwen3moe),
    "llama": ArchSpec(("mixtral",), _mixtral, permute_qk=True),  # with experts: Mixtral (llama.cpp has no arch of its own)
    "deepseek2": ArchSpec(("deepseek_v2", "deepseek_v3"), _deepseek2),
    "glm4moe": ArchSpec(("glm4_moe",), _glm4moe),
    "gpt-oss": ArchSpec(("gpt_oss",), _gpt_oss),
    "phimoe": ArchSpec(("phimoe",), _phimoe),
}


def arch_spec(arch: str, metadata: dict) -> ArchSpec:
    if arch == "llama" and not metadata.get("llama.expert_count"):
        raise GgufError("this GGUF is a dense llama model (no llama.expert_count): moetier runs Mixture-of-Experts "
                        "models", hint=f"GGUF architectures moetier runs: {', '.join(ARCHES)} (llama with experts)")
    if arch not in ARCHES:
        raise GgufError(f"GGUF architecture {arch!r} is not one moetier runs",
                        hint=f"GGUF architectures moetier runs: {', '.join(ARCHES)} (llama with experts)")
    return ARCHES[arch]


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's converter's `permute` (LlamaModel.permute: each head's rows from rotate-half's
    order to interleaved pairs), for Q or K [heads·head_dim, ...]."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
