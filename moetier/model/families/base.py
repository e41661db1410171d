"""What every family shares: reading config.json fields and naming tensors in the checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

from moetier.config import ROPE_KINDS, ModelSpec, RopeSpec
from moetier.errors import UnsupportedModelError


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_SIZE = 1 << 24  # larger than any dimension, layer or expert count of a real model; keeps a typo from
# asking for billions of layers


def require(cfg: dict, key: str) -> int:
    """A size the model cannot do without: a positive integer."""
    if key not in cfg or cfg[key] is None:
        raise UnsupportedModelError(f"config.json has no {key!r}, which a {cfg.get('model_type')} model needs")
    if not _is_int(cfg[key]) or not 0 < cfg[key] <= MAX_SIZE:
        raise UnsupportedModelError(f"config.json: {key} must be a positive integer up to {MAX_SIZE}, got "
                                    f"{cfg[key]!r}")
    return cfg[key]


def optional_int(cfg: dict, key: str, default: int | None = None) -> int | None:
    """A size that may be absent (or null): `default` then; otherwise a non-negative integer."""
    value = cfg.get(key)
    if value is None:
        return default
    if not _is_int(value) or not 0 <= value <= MAX_SIZE:
        raise UnsupportedModelError(f"config.json: {key} must be a non-negative integer up to {MAX_SIZE}, got "
                                    f"{value!r}")
    return value


def optional_number(cfg: dict, key: str) -> float | None:
    return None if cfg.get(key) is None else number(cfg, key, 0.0)


def number(cfg: dict, key: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UnsupportedModelError(f"config.json: {key} must be a number, got {value!r}")
    return float(value)


def rope_parameters(cfg: dict) -> dict:
    """The RoPE parameters however the checkpoint spells them: transformers 5's rope_parameters, or the older
    rope_scaling beside rope_theta (and a partial_rotary_factor at the top level)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise UnsupportedModelError("config.json: rope_parameters and rope_scaling must be objects")
    if params and not all(isinstance(v, (int, float, str, bool, list, type(None))) for v in params.values()):
        raise UnsupportedModelError("config.json: rope_parameters differ per layer type, which moetier does not run")
    merged = {**scaling, **params}
    merged.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in cfg:
        merged.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    merged["rope_type"] = merged.get("rope_type") or merged.get("type") or "default"
    return merged


def rope_spec(cfg: dict, head_dim: int, interleaved: bool = False) -> RopeSpec:
    """What config.json says of the rotary embedding of a head of `head_dim` dimensions (before a partial factor)."""
    p = rope_parameters(cfg)
    kind = p["rope_type"]
    if kind not in ROPE_KINDS:
        raise UnsupportedModelError(f"config.json asks for RoPE type {kind!r}, which moetier does not run",
                                    hint=f"moetier runs RoPE types {', '.join(ROPE_KINDS)}")
    partial = number(p, "partial_rotary_factor", 1.0)
    if not 0 < partial <= 1:
        raise UnsupportedModelError(f"config.json: partial_rotary_factor must be in (0, 1], got {partial}")
    dim = int(head_dim * partial)
    fields = dict(theta=number(p, "rope_theta", 10000.0), dim=dim, interleaved=interleaved, kind=kind)
    if kind == "default":
        return RopeSpec(**fields)
    # a top-level original_max_position_embeddings wins over the rope parameters' own, as in transformers (Phi-3)
    key = "original_max_position_embeddings"
    original = optional_int({key: cfg.get(key) or p.get(key)}, key) or require(cfg, "max_position_embeddings")
    factor = optional_number(p, "factor")
    fields.update(original_max_position_embeddings=original,
                  factor=require(cfg, "max_position_embeddings") / original if factor is None else factor,
                  attention_factor=optional_number(p, "attention_factor"))
    if kind == "yarn":
        fields.update(beta_fast=optional_number(p, "beta_fast") or 32.0,  # (transformers: a 0 or null is the default)
                      beta_slow=optional_number(p, "beta_slow") or 1.0,
                      mscale=optional_number(p, "mscale") or 0.0,
                      mscale_all_dim=optional_number(p, "mscale_all_dim") or 0.0,
                      truncate=bool(p.get("truncate", True)))
    else:
        fields.update(short_factor=numbers(p, "short_factor"), long_factor=numbers(p, "long_factor"),
                      short_mscale=optional_number(p, "short_mscale"), long_mscale=optional_number(p, "long_mscale"))
    return RopeSpec(**fields)


def numbers(cfg: dict, key: str) -> tuple[float, ...]:
    value = cfg.get(key)
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise UnsupportedModelError(f"config.json: {key} must be a list of numbers, got {value!r}")
    return tuple(float(v) for v in value)


def token_ids(value, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(_is_int(i) and i >= 0 for i in ids):
        raise UnsupportedModelError(f"config.json: {key} must be a token id or a list of them, got {value!r}")
    return tuple(ids)


def common_fields(cfg: dict, rope_head_dim: int | None = None, interleaved: bool = False) -> dict:
    """Fields parsed the same way in every family (`rope_head_dim`: the head dimensions RoPE applies to, when not
    the head's own, as in latent attention)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    hidden, heads = require(cfg, "hidden_size"), require(cfg, "num_attention_heads")
    head_dim = optional_int(cfg, "head_dim") or hidden // heads
    return dict(
        vocab_size=require(cfg, "vocab_size"),
        hidden_size=hidden,
        num_layers=require(cfg, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=optional_int(cfg, "num_key_value_heads") or heads,
        head_dim=head_dim,
        top_k=require(cfg, "num_experts_per_tok"),
        rope=rope_spec(cfg, rope_head_dim or head_dim, interleaved),
        rms_norm_eps=number(cfg, "rms_norm_eps", 1e-6),
        max_position_embeddings=require(cfg, "max_position_embeddings"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").removeprefix("torch."),
        bos_token_id=(token_ids(cfg.get("bos_token_id"), "bos_token_id") or (None,))[0],
        eos_token_ids=token_ids(cfg.get("eos_token_id"), "eos_token_id"),
        expert_groups=expert_groups(cfg),
        hf_config=cfg,
    )


def expert_groups(cfg: dict) -> tuple[tuple[int, ...], ...]:
    """A merged model's groups (moetier_merged.groups: per MoE layer, each expert's principal), or ()."""
    merged = cfg.get("moetier_merged")
    if merged is None:
        return ()
    groups = merged.get("groups") if isinstance(merged, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, list) and all(_is_int(i) for i in g) for g in groups):
        raise UnsupportedModelError(f"config.json: moetier_merged.groups must be a list of lists of expert ids, "
                                    f"got {str(groups)[:80]!r}")
    return tuple(tuple(g) for g in groups)


def sparse_layers(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """Qwen-style placement of MoE layers: every decoder_sparse_step-th layer, except mlp_only_layers."""
    step = optional_int(cfg, "decoder_sparse_step") or 1
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(_is_int(i) for i in dense):
        raise UnsupportedModelError(f"config.json: mlp_only_layers must be a list of layer numbers, got {dense!r}")
    return tuple(i for i in range(num_layers) if i not in set(dense) and (i + 1) % step == 0)


@dataclass(frozen=True)
class Family:
    """One model family: how its config parses and where its tensors live in a Hugging Face checkpoint."""

    name: str
    model_types: tuple[str, ...]
    moe_prefix: str  # module holding router and experts, e.g. "mlp" or "block_sparse_moe"
    router_name: str  # router weight inside moe_prefix
    expert_proj: tuple[str, str, str]  # per-expert (gate, up, down) names in the legacy layout
    expert_intermediate_key: str = "intermediate_size"  # the config.json field that sizes a routed expert
    expert_format: str = "stacked"  # how the checkpoint lays out experts (moetier/store/sources.py)
    dequantizes: tuple[str, ...] = ()  # quantization methods whose checkpoints conversion dequantizes

    def parse(self, cfg: dict) -> ModelSpec:
        raise NotImplementedError

    def dense_names(self, spec: ModelSpec) -> dict[str, str]:
        """Our canonical name -> the checkpoint's name, for every non-expert tensor."""
        names = {"embed_tokens": "model.embed_tokens.weight", **self.norm_names(spec, "norm", "model.norm")}
        if not spec.tie_word_embeddings:
            names["lm_head"] = "lm_head.weight"
        if spec.lm_head_bias:
            names["lm_head.bias"] = "lm_head.bias"
        for i in range(spec.num_layers):
            ours, hf = f"layers.{i}.", f"model.layers.{i}."
            names.update(self.norm_names(spec, ours + "input_norm", hf + "input_layernorm"))
            names.update(self.norm_names(spec, ours + "post_attn_norm", hf + "post_attention_layernorm"))
            names.update(self.attention_names(spec, ours, hf + "self_attn."))
            if i in spec.moe_layers:
                names.update(self.router_names(spec, ours, hf + f"{self.moe_prefix}.{self.router_name}."))
                names.update(self.shared_expert_names(spec, i))
            else:
                for p in ("gate", "up", "down"):
                    names[ours + f"mlp.{p}_proj"] = hf + f"mlp.{p}_proj.weight"
        return names

    def norm_names(self, spec: ModelSpec, ours: str, hf: str) -> dict[str, str]:
        names = {ours: hf + ".weight"}
        if spec.norm == "layernorm":
            names[ours + ".bias"] = hf + ".bias"
        return names

    def attention_names(self, spec: ModelSpec, ours: str, hf: str) -> dict[str, str]:
        """Grouped-query attention's q, k, v, o (and biases, norms, sinks) of a layer; `hf` ends in `self_attn.`."""
        names = {ours + f"{p}_proj": hf + f"{p}_proj.weight" for p in "qkvo"}
        if spec.qkv_bias:
            names.update({ours + f"{p}_proj.bias": hf + f"{p}_proj.bias" for p in "qkv"})
        if spec.o_bias:
            names[ours + "o_proj.bias"] = hf + "o_proj.bias"
        if spec.qk_norm != "none":
            names[ours + "q_norm"] = hf + "q_norm.weight"
            names[ours + "k_norm"] = hf + "k_norm.weight"
        if spec.attention_sinks:
            names[ours + "sinks"] = hf + "sinks"
        return names

    def router_names(self, spec: ModelSpec, ours: str, hf: str) -> dict[str, str]:
        """The router's weight (and bias, and DeepSeek-V3's e_score_correction_bias); `hf` ends in its module's dot."""
        names = {ours + "router": hf + "weight"}
        if spec.router.bias:
            names[ours + "router.bias"] = hf + "bias"
        if spec.router.kind == "noaux-tc":
            names[ours + "router.e_score_correction_bias"] = hf + "e_score_correction_bias"
        return names

    def shared_expert_names(self, spec: ModelSpec, layer: int) -> dict[str, str]:
        return {}

    def expert_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """(gate, up, down) weight names of one expert in the per-expert checkpoint layout."""
        base = f"model.layers.{layer}.{self.moe_prefix}.experts.{expert}."
        return tuple(base + p + ".weight" for p in self.expert_proj)

    def fused_expert_names(self, layer: int) -> tuple[str, str]:
        """(gate_up_proj [E, 2I, H], down_proj [E, H, I]) in the fused layout transformers 5 uses in memory."""
        base = f"model.layers.{layer}.{self.moe_prefix}.experts."
        return base + "gate_up_proj", base + "down_proj"
