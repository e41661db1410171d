"""What a policy may know about the cache it serves, given when it is made. Whatever a policy learned offline
(moetier/policy_files.py) or, for the offline optimum, the future it will face, is handed to it beside this."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyContext:
    num_slots: int  # experts the cache holds at the model's own precision
    layers: tuple[int, ...]  # the MoE layers, in execution order
    num_experts: int
    top_k: int

    def __post_init__(self) -> None:
        if self.num_slots < 1 or not self.layers or self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"inconsistent policy context: {self}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)
