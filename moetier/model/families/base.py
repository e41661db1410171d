"""What every family shares: reading config.json fields and naming tensors in the checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

from moetier.config import ModelSpec
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


def number(cfg: dict, key: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UnsupportedModelError(f"config.json: {key} must be a number, got {value!r}")
    return float(value)


def rope_theta(cfg: dict) -> float:
    """The RoPE base; only plain RoPE is supported (no scaling variants)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise UnsupportedModelError("config.json: rope_parameters and rope_scaling must be objects")
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedModelError(f"config.json asks for RoPE type {rope_type!r}; moetier supports plain RoPE only")
    return number(params, "rope_theta", number(cfg, "rope_theta", 10000.0))


def token_ids(value, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(_is_int(i) and i >= 0 for i in ids):
        raise UnsupportedModelError(f"config.json: {key} must be a token id or a list of them, got {value!r}")
    return tuple(ids)


def common_fields(cfg: dict) -> dict:
    """Fields parsed the same way in every family."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    hidden, heads = require(cfg, "hidden_size"), require(cfg, "num_attention_heads")
    return dict(
        vocab_size=require(cfg, "vocab_size"),
        hidden_size=hidden,
        num_layers=require(cfg, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=optional_int(cfg, "num_key_value_heads") or heads,
        head_dim=optional_int(cfg, "head_dim") or hidden // heads,
        top_k=require(cfg, "num_experts_per_tok"),
        rope_theta=rope_theta(cfg),
        rms_norm_eps=number(cfg, "rms_norm_eps", 1e-6),
        max_position_embeddings=require(cfg, "max_position_embeddings"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").removeprefix("torch."),
        bos_token_id=(token_ids(cfg.get("bos_token_id"), "bos_token_id") or (None,))[0],
        eos_token_ids=token_ids(cfg.get("eos_token_id"), "eos_token_id"),
        hf_config=cfg,
    )


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

    def parse(self, cfg: dict) -> ModelSpec:
        raise NotImplementedError

    def dense_names(self, spec: ModelSpec) -> dict[str, str]:
        """Our canonical name -> the checkpoint's name, for every non-expert tensor."""
        names = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight"}
        if not spec.tie_word_embeddings:
            names["lm_head"] = "lm_head.weight"
        for i in range(spec.num_layers):
            ours, hf = f"layers.{i}.", f"model.layers.{i}."
            names[ours + "input_norm"] = hf + "input_layernorm.weight"
            names[ours + "post_attn_norm"] = hf + "post_attention_layernorm.weight"
            for p in ("q", "k", "v", "o"):
                names[ours + f"{p}_proj"] = hf + f"self_attn.{p}_proj.weight"
            if spec.qkv_bias:
                for p in ("q", "k", "v"):
                    names[ours + f"{p}_proj.bias"] = hf + f"self_attn.{p}_proj.bias"
            if spec.o_bias:
                names[ours + "o_proj.bias"] = hf + "self_attn.o_proj.bias"
            if spec.qk_norm != "none":
                names[ours + "q_norm"] = hf + "self_attn.q_norm.weight"
                names[ours + "k_norm"] = hf + "self_attn.k_norm.weight"
            if i in spec.moe_layers:
                names[ours + "router"] = hf + f"{self.moe_prefix}.{self.router_name}.weight"
                names.update(self.shared_expert_names(spec, i))
            else:
                for p in ("gate", "up", "down"):
                    names[ours + f"mlp.{p}_proj"] = hf + f"mlp.{p}_proj.weight"
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
