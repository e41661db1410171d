"""DeepSeek-V2 / V2-Lite and DeepSeek-V3 / Moonlight, and GLM-4.5 routed like V3.

All three: the first `first_k_dense_replace` layers dense, then MoE layers with `n_shared_experts` ungated shared
experts beside the routed ones, routers computed in fp32 whose top-k weights stay fp32. DeepSeek's attention is
multi-head latent attention (moetier/model/mla.py) with RoPE on interleaved pairs (V2 always; V3 unless
rope_interleave is false); GLM's is grouped-query attention with partial RoPE, q/k/v biases and per-head q/k norms.

- V2: softmax scores; `greedy` top-k, or `group_limited_greedy` within the topk_group groups of best maximum;
  weights times routed_scaling_factor (transformers' V2 router never renormalises, whatever norm_topk_prob says).
- V3 / Moonlight / GLM-4.5: noaux_tc (moetier/model/router.py's NoAuxRouter).

DeepSeek-MoE-16B (V1, model_type `deepseek`) has no class in transformers: its checkpoint needs remote code, so
there is no reference to be exact against, and it is refused (families/__init__.py); the simulator keeps its
shape."""

from __future__ import annotations

from moetier.config import LatentAttentionSpec, ModelSpec, RouterSpec
from moetier.errors import UnsupportedModelError
from moetier.model.families.base import Family, common_fields, number, optional_int, require

V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def moe_fields(cfg: dict, num_layers: int) -> dict:
    """Experts, shared experts and the dense first layers, as DeepSeek and GLM name them."""
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("config.json: mlp_bias (biases on the dense and shared MLPs) is not supported")
    first_dense = optional_int(cfg, "first_k_dense_replace", 0)
    if first_dense >= num_layers:
        raise UnsupportedModelError(f"config.json: first_k_dense_replace {first_dense} leaves no MoE layer of "
                                    f"{num_layers}")
    moe = require(cfg, "moe_intermediate_size")
    return dict(num_experts=require(cfg, "n_routed_experts"), moe_intermediate_size=moe,
                shared_expert_intermediate_size=moe * (optional_int(cfg, "n_shared_experts") or 0),
                intermediate_size=optional_int(cfg, "intermediate_size", 0),
                moe_layers=tuple(range(first_dense, num_layers)))


def noaux_router(cfg: dict) -> RouterSpec:
    return RouterSpec("noaux-tc", norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                      scaling_factor=number(cfg, "routed_scaling_factor", 1.0), num_groups=require(cfg, "n_group"),
                      topk_groups=require(cfg, "topk_group"), fp32=True, fp32_weights=True)


def latent_attention(cfg: dict) -> LatentAttentionSpec:
    return LatentAttentionSpec(kv_lora_rank=require(cfg, "kv_lora_rank"),
                               qk_nope_head_dim=require(cfg, "qk_nope_head_dim"),
                               qk_rope_head_dim=require(cfg, "qk_rope_head_dim"), v_head_dim=require(cfg, "v_head_dim"),
                               q_lora_rank=optional_int(cfg, "q_lora_rank"))


class DeepseekFamily(Family):
    def router(self, cfg: dict) -> RouterSpec:
        raise NotImplementedError

    def interleaved(self, cfg: dict) -> bool:
        return True

    def parse(self, cfg: dict) -> ModelSpec:
        mla = latent_attention(cfg)
        fields = common_fields(cfg, rope_head_dim=mla.qk_rope_head_dim, interleaved=self.interleaved(cfg))
        bias = bool(cfg.get("attention_bias", False))
        return ModelSpec(family=self.name, router=self.router(cfg), latent_attention=mla, qkv_bias=bias, o_bias=bias,
                         **moe_fields(cfg, fields["num_layers"]), **fields)

    def attention_names(self, spec: ModelSpec, ours: str, hf: str) -> dict[str, str]:
        mla = spec.latent_attention
        names = {ours + "kv_a_proj": hf + "kv_a_proj_with_mqa.weight", ours + "kv_a_norm": hf + "kv_a_layernorm.weight",
                 ours + "kv_b_proj": hf + "kv_b_proj.weight", ours + "o_proj": hf + "o_proj.weight"}
        if mla.q_lora_rank is None:
            names[ours + "q_proj"] = hf + "q_proj.weight"
        else:
            names.update({ours + "q_a_proj": hf + "q_a_proj.weight", ours + "q_a_norm": hf + "q_a_layernorm.weight",
                          ours + "q_b_proj": hf + "q_b_proj.weight"})
        if spec.qkv_bias:  # attention_bias: the down-projections and o (q_proj and the up-projections never)
            names.update({ours + "kv_a_proj.bias": hf + "kv_a_proj_with_mqa.bias", ours + "o_proj.bias": hf + "o_proj.bias"})
            if mla.q_lora_rank is not None:
                names[ours + "q_a_proj.bias"] = hf + "q_a_proj.bias"
        return names

    def shared_expert_names(self, spec: ModelSpec, layer: int) -> dict[str, str]:
        if not spec.shared_expert_intermediate_size:
            return {}
        ours, hf = f"layers.{layer}.", f"model.layers.{layer}.mlp.shared_experts."
        return {ours + f"shared.{p}_proj": hf + f"{p}_proj.weight" for p in ("gate", "up", "down")}


class DeepseekV2Family(DeepseekFamily):
    """DeepSeek-V2 / V2-Lite: MLA, softmax greedy or group-limited top-k, shared experts, dense first layers."""

    def router(self, cfg: dict) -> RouterSpec:
        method = cfg.get("topk_method") or "greedy"
        if method not in V2_TOPK_METHODS:
            raise UnsupportedModelError(f"config.json: DeepSeek-V2 topk_method {method!r} is not one transformers "
                                        f"runs", hint=f"one of {', '.join(V2_TOPK_METHODS)}")
        scaling = number(cfg, "routed_scaling_factor", 1.0)
        if method == "greedy":
            return RouterSpec("softmax", scaling_factor=scaling, fp32=True, fp32_weights=True)
        return RouterSpec("group-limited", scaling_factor=scaling, num_groups=require(cfg, "n_group"),
                          topk_groups=require(cfg, "topk_group"), fp32=True, fp32_weights=True)


class DeepseekV3Family(DeepseekFamily):
    """DeepSeek-V3 / Moonlight: MLA, sigmoid noaux_tc routing, shared experts, dense first layers, YaRN."""

    def router(self, cfg: dict) -> RouterSpec:
        return noaux_router(cfg)

    def interleaved(self, cfg: dict) -> bool:
        return bool(cfg.get("rope_interleave", True))


class Glm4MoeFamily(DeepseekFamily):
    """GLM-4.5 / 4.5-Air: DeepSeek-V3's routing and shared experts on GQA with partial RoPE."""

    def parse(self, cfg: dict) -> ModelSpec:
        fields = common_fields(cfg)
        return ModelSpec(family=self.name, router=noaux_router(cfg), qkv_bias=bool(cfg.get("attention_bias", False)),
                         qk_norm="head" if cfg.get("use_qk_norm") else "none", **moe_fields(cfg, fields["num_layers"]),
                         **fields)

    def attention_names(self, spec: ModelSpec, ours: str, hf: str) -> dict[str, str]:
        return Family.attention_names(self, spec, ours, hf)


PROJ = ("gate_proj", "up_proj", "down_proj")
DEEPSEEK_V2 = DeepseekV2Family("deepseek_v2", ("deepseek_v2",), "mlp", "gate", PROJ, "moe_intermediate_size")
DEEPSEEK_V3 = DeepseekV3Family("deepseek_v3", ("deepseek_v3",), "mlp", "gate", PROJ, "moe_intermediate_size")
GLM4_MOE = Glm4MoeFamily("glm4_moe", ("glm4_moe",), "mlp", "gate", PROJ, "moe_intermediate_size")
