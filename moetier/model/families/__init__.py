"""The supported model families, found by config.json's model_type."""

from __future__ import annotations

from moetier.config import ModelSpec
from moetier.errors import UnsupportedModelError
from moetier.model.families.base import Family
from moetier.model.families.mixtral import MIXTRAL
from moetier.model.families.olmoe import OLMOE
from moetier.model.families.qwen2_moe import QWEN2_MOE
from moetier.model.families.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {f.name: f for f in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE)}
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}


def family_for(cfg: dict) -> Family:
    model_type = cfg.get("model_type")
    if model_type not in _BY_MODEL_TYPE:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported",
            hint=f"moetier runs these families: {', '.join(sorted(_BY_MODEL_TYPE))}")
    return _BY_MODEL_TYPE[model_type]


def parse_spec(cfg: dict) -> ModelSpec:
    return family_for(cfg).parse(cfg)


__all__ = ["FAMILIES", "Family", "family_for", "parse_spec"]
