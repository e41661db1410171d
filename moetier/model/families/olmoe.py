"""OLMoE: RMSNorm on the whole q and k projections (all heads at once), optional clip_qkv,
and no renormalisation of the top-k weights unless norm_topk_prob."""

from moetier.config import ModelSpec, RouterSpec
from moetier.model.families.base import Family, common_fields, number, require


class OlmoeFamily(Family):
    """OLMoE: softmax top-k, q/k norms over all heads, optional clip_qkv."""

    def parse(self, cfg: dict) -> ModelSpec:
        fields = common_fields(cfg)
        bias = bool(cfg.get("attention_bias", False))
        return ModelSpec(
            family=self.name,
            num_experts=require(cfg, "num_experts"),
            moe_intermediate_size=require(cfg, "intermediate_size"),
            router=RouterSpec(norm_topk_prob=bool(cfg.get("norm_topk_prob", False))),
            moe_layers=tuple(range(fields["num_layers"])),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm="full",
            clip_qkv=None if cfg.get("clip_qkv") is None else number(cfg, "clip_qkv", 0.0),
            **fields,
        )


OLMOE = OlmoeFamily("olmoe", ("olmoe",), "mlp", "gate", ("gate_proj", "up_proj", "down_proj"))
