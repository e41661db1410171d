"""gpt-oss: attention with a learned sink logit per head, sliding-window and full layers alternating (layer_types),
q/k/v/o biases, YaRN; a router with a bias whose top-k logits alone are softmaxed; experts with biases and a clamped
SwiGLU (gate·sigmoid(1.702·gate)·(up + 1), ±7); RMSNorm applying its weight in fp32. The released checkpoints hold
the experts in MXFP4, which conversion dequantizes to bf16: the store holds bf16 experts, 3.8× the checkpoint's
expert bytes (MXFP4 is 4.25 bits a weight)."""

from moetier.config import ModelSpec, RouterSpec
from moetier.errors import UnsupportedModelError
from moetier.model.families.base import Family, common_fields, number, optional_int, require

LAYER_TYPES = ("sliding_attention", "full_attention")


def windows(cfg: dict, num_layers: int) -> tuple:
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                       for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise UnsupportedModelError(f"config.json: layer_types must list {num_layers} of {LAYER_TYPES}, got {types!r}")
    window = optional_int(cfg, "sliding_window")
    return tuple(window if t == "sliding_attention" else None for t in types) if window else ()


class GptOssFamily(Family):
    """gpt-oss: attention sinks, alternating sliding windows, clamped SwiGLU experts with biases; MXFP4 dequantized."""

    def parse(self, cfg: dict) -> ModelSpec:
        fields = common_fields(cfg)
        bias = bool(cfg.get("attention_bias", True))
        return ModelSpec(
            family=self.name,
            num_experts=require(cfg, "num_local_experts"),
            moe_intermediate_size=require(cfg, "intermediate_size"),
            router=RouterSpec("topk-softmax", bias=True),
            moe_layers=tuple(range(fields["num_layers"])),
            qkv_bias=bias,
            o_bias=bias,
            attention_sinks=True,
            norm="rms-fp32-weight",
            activation="swiglu-clamped",
            swiglu_alpha=number(cfg, "swiglu_alpha", 1.702),
            swiglu_limit=number(cfg, "swiglu_limit", 7.0),
            sliding_windows=windows(cfg, fields["num_layers"]),
            **fields,
        )


GPT_OSS = GptOssFamily("gpt_oss", ("gpt_oss",), "mlp", "router", ("gate_up_proj", "gate_up_proj", "down_proj"),
                       expert_format="gpt-oss", dequantizes=("mxfp4",))
