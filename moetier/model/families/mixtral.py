"""Mixtral: softmax over all experts, top-k, renormalised; no biases, no q/k norms; optional sliding window."""

from moetier.config import ModelSpec, RouterSpec
from moetier.model.families.base import Family, common_fields, optional_int, require


class MixtralFamily(Family):
    """Mixtral: softmax top-k renormalised, GQA with RoPE and an optional sliding window."""

    def parse(self, cfg: dict) -> ModelSpec:
        fields = common_fields(cfg)
        window = optional_int(cfg, "sliding_window")
        return ModelSpec(
            family=self.name,
            num_experts=require(cfg, "num_local_experts"),
            moe_intermediate_size=require(cfg, "intermediate_size"),
            router=RouterSpec(norm_topk_prob=True, fp32_weights=True),
            moe_layers=tuple(range(fields["num_layers"])),
            sliding_windows=(window,) * fields["num_layers"] if window else (),
            **fields,
        )


MIXTRAL = MixtralFamily("mixtral", ("mixtral",), "block_sparse_moe", "gate", ("w1", "w3", "w2"))
