"""What a policy may know about the cache it serves, given when it is made. Whatever a policy learned offline
(moetier/policy_files.py) or, for the offline optimum, the future it will face, is handed to it beside this."""

from __future__ import annotations

from dataclasses import dataclass

from moetier.quant.precisions import QUANTIZED as PRECISIONS

QUANTIZED = frozenset(PRECISIONS)


@dataclass(frozen=True)
class PolicyContext:
    num_slots: int  # experts the cache holds at the model's own precision
    layers: tuple[int, ...]  # the MoE layers, in execution order
    num_experts: int
    top_k: int
    high_precision: str | None = None  # uses at this precision are "high" (HOBBIT's LHU); None: any float one

    def is_high(self, precision: str) -> bool:
        """Whether a use at `precision` is a high-precision use: the configured high precision (int8 in HOBBIT's
        int8+int2 pair), or, when none is configured, any unquantized one."""
        if self.high_precision is not None:
            return precision == self.high_precision
        return precision not in QUANTIZED

    def __post_init__(self) -> None:
        if self.num_slots < 1 or not self.layers or self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"inconsistent policy context: {self}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)
