"""Qwen3-MoE: RMSNorm on q and k per head (over head_dim) before RoPE; no shared expert."""

from moetier.config import ModelSpec, RouterSpec
from moetier.model.families.base import Family, common_fields, optional_int, require, sparse_layers


class Qwen3MoeFamily(Family):
    """Qwen3-MoE: softmax top-k renormalised, per-head q/k norms."""

    def parse(self, cfg: dict) -> ModelSpec:
        fields = common_fields(cfg)
        window = optional_int(cfg, "sliding_window") if cfg.get("use_sliding_window") else None
        bias = bool(cfg.get("attention_bias", False))
        return ModelSpec(
            family=self.name,
            num_experts=optional_int(cfg, "num_experts") or require(cfg, "num_local_experts"),
            moe_intermediate_size=require(cfg, "moe_intermediate_size"),
            intermediate_size=optional_int(cfg, "intermediate_size", 0),
            router=RouterSpec(norm_topk_prob=bool(cfg.get("norm_topk_prob", False))),
            moe_layers=sparse_layers(cfg, fields["num_layers"]),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm="head",
            sliding_windows=(window,) * fields["num_layers"] if window else (),
            **fields,
        )


QWEN3_MOE = Qwen3MoeFamily("qwen3_moe", ("qwen3_moe",), "mlp", "gate", ("gate_proj", "up_proj", "down_proj"),
                           "moe_intermediate_size")
