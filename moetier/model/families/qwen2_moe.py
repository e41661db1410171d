"""Qwen2-MoE (Qwen1.5-MoE): q/k/v biases, a shared expert scaled by sigmoid(shared_expert_gate(x)),
top-k weights renormalised only if norm_topk_prob, sliding windows on the first max_window_layers."""

from moetier.config import ModelSpec, RouterSpec
from moetier.errors import UnsupportedModelError
from moetier.model.families.base import Family, common_fields, optional_int, require, sparse_layers


def qwen2_windows(cfg: dict, num_layers: int) -> tuple:
    if not cfg.get("use_sliding_window"):
        return ()
    types = cfg.get("layer_types")
    if types is None:  # transformers' default placement
        last = optional_int(cfg, "max_window_layers", 28)
        types = ["sliding_attention" if (i + 1) % 2 and i < last else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list):
        raise UnsupportedModelError(f"config.json: layer_types must be a list, got {types!r}")
    window = optional_int(cfg, "sliding_window")
    return tuple(window if t == "sliding_attention" else None for t in types)


class Qwen2MoeFamily(Family):
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B): a sigmoid-gated shared expert, q/k/v biases."""

    def parse(self, cfg: dict) -> ModelSpec:
        fields = common_fields(cfg)
        return ModelSpec(
            family=self.name,
            num_experts=require(cfg, "num_experts"),
            moe_intermediate_size=require(cfg, "moe_intermediate_size"),
            intermediate_size=optional_int(cfg, "intermediate_size", 0),
            shared_expert_intermediate_size=require(cfg, "shared_expert_intermediate_size"),
            shared_expert_gated=True,
            router=RouterSpec(norm_topk_prob=bool(cfg.get("norm_topk_prob", False))),
            moe_layers=sparse_layers(cfg, fields["num_layers"]),
            qkv_bias=bool(cfg.get("qkv_bias", True)),
            sliding_windows=qwen2_windows(cfg, fields["num_layers"]),
            **fields,
        )

    def shared_expert_names(self, spec: ModelSpec, layer: int) -> dict[str, str]:
        ours, hf = f"layers.{layer}.", f"model.layers.{layer}.mlp."
        names = {ours + f"shared.{p}_proj": hf + f"shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")}
        names[ours + "shared_gate"] = hf + "shared_expert_gate.weight"
        return names


QWEN2_MOE = Qwen2MoeFamily("qwen2_moe", ("qwen2_moe",), "mlp", "gate", ("gate_proj", "up_proj", "down_proj"),
                           "moe_intermediate_size")
