"""Identity of an expert in the cache."""

from typing import NamedTuple

Precision = str  # "bf16", "fp32", "fp16"; later "int8", "int4"


class ExpertKey(NamedTuple):
    layer: int
    expert: int
