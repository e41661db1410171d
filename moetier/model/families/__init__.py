"""The supported model families, found by config.json's model_type."""

from __future__ import annotations

from moetier.config import ModelSpec
from moetier.errors import UnsupportedModelError, parsing
from moetier.model.families.base import Family
from moetier.model.families.deepseek import DEEPSEEK_V2, DEEPSEEK_V3, GLM4_MOE
from moetier.model.families.gpt_oss import GPT_OSS
from moetier.model.families.mixtral import MIXTRAL
from moetier.model.families.olmoe import OLMOE
from moetier.model.families.phimoe import PHIMOE
from moetier.model.families.qwen2_moe import QWEN2_MOE
from moetier.model.families.qwen3_moe import QWEN3_MOE
from moetier.model.families.switch import SWITCH

FAMILIES: dict[str, Family] = {f.name: f for f in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE, DEEPSEEK_V2, DEEPSEEK_V3,
                                                    GLM4_MOE, PHIMOE, GPT_OSS, SWITCH)}
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}
# model types refused for a reason beyond "not built"
REFUSED = {
    "deepseek": "DeepSeek-MoE-16B (V1) has no class in transformers: its checkpoint runs only with remote code, so "
                "there is no reference to hold moetier's output against. The simulator has its shape "
                "(`moetier sim --model-shape deepseek-moe-16b ...`)",
}


def family_for(cfg: dict) -> Family:
    if not isinstance(cfg, dict):
        raise UnsupportedModelError(f"config.json must hold a JSON object, not {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and model_type in REFUSED:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported: {REFUSED[model_type]}",
                                    hint=f"moetier runs these families: {', '.join(sorted(_BY_MODEL_TYPE))}")
    if not isinstance(model_type, str) or model_type not in _BY_MODEL_TYPE:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported",
            hint=f"moetier runs these families: {', '.join(sorted(_BY_MODEL_TYPE))}")
    return _BY_MODEL_TYPE[model_type]


def parse_spec(cfg: dict) -> ModelSpec:
    """The model's spec from its config.json; a malformed config is an UnsupportedModelError naming the field."""
    family = family_for(cfg)
    check_quantization(cfg, family)
    with parsing("config.json", UnsupportedModelError):
        return family.parse(cfg)


def check_quantization(cfg: dict, family: Family) -> None:
    """A quantized checkpoint is refused unless conversion dequantizes its method (gpt-oss's MXFP4)."""
    q = cfg.get("quantization_config")
    if not q:
        return
    method = q.get("quant_method") if isinstance(q, dict) else q
    if method not in family.dequantizes:
        raise UnsupportedModelError(
            f"the checkpoint is quantized ({method!r}); moetier converts float checkpoints"
            f"{' and ' + ', '.join(family.dequantizes) if family.dequantizes else ''}",
            hint="convert a bf16/fp16/fp32 release of the model (and let moetier quantize: --precisions int8,int4)")


__all__ = ["FAMILIES", "Family", "family_for", "parse_spec"]
