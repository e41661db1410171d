"""Phi-3.5-MoE: Mixtral's layout with LayerNorm (weight and bias) instead of RMSNorm, biases on q/k/v/o and
optionally on the head, a sliding window on every layer if set, LongRoPE, and sparsemixer routing — at
evaluation the best expert weighted by a softmax over the logits within 2·router_jitter_noise of it, then the same
for the best of the rest (moetier/model/router.py). It always chooses two experts."""

from moetier.config import ModelSpec, RouterSpec
from moetier.model.families.base import Family, common_fields, number, optional_int, require


class PhimoeFamily(Family):
    """Phi-3.5-MoE: sparsemixer top-2, LayerNorm, biases, LongRoPE."""

    def parse(self, cfg: dict) -> ModelSpec:
        fields = common_fields(cfg)
        window = optional_int(cfg, "sliding_window")
        bias = bool(cfg.get("attention_bias", False))
        return ModelSpec(
            family=self.name,
            num_experts=require(cfg, "num_local_experts"),
            moe_intermediate_size=require(cfg, "intermediate_size"),
            router=RouterSpec("sparsemixer", jitter_eps=number(cfg, "router_jitter_noise", 0.01)),
            moe_layers=tuple(range(fields["num_layers"])),
            qkv_bias=bias,
            o_bias=bias,
            norm="layernorm",
            lm_head_bias=bool(cfg.get("lm_head_bias", False)),
            sliding_windows=(window,) * fields["num_layers"] if window else (),
            **fields,
        )


PHIMOE = PhimoeFamily("phimoe", ("phimoe",), "block_sparse_moe", "gate", ("w1", "w3", "w2"))
