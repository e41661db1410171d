"""What a policy may know about the cache it serves, given when it is made."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moetier.errors import MoetierError

if TYPE_CHECKING:
    from moetier.trace.format import Trace


@dataclass(frozen=True)
class PolicyContext:
    num_slots: int
    layers: tuple[int, ...]  # the MoE layers, in execution order
    num_experts: int
    top_k: int
    model_dir: Path | None = None  # trained policy files live in model_dir/policies/<name>.json
    trace: Trace | None = None  # the routing a replay will drive: the future for offline policies

    def __post_init__(self) -> None:
        if self.num_slots < 1 or not self.layers or self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"inconsistent policy context: {self}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def trained_file(self, policy: str) -> Path:
        """`policies/<policy>.json` beside the model: every learned policy is refused alike without it."""
        path = self.model_dir / "policies" / f"{policy}.json" if self.model_dir else None
        if path is None or not path.exists():
            where = f" ({path} does not exist)" if path else " (no model directory to look in)"
            raise MoetierError(f"{policy} is a learned policy and has no trained file for this model{where}",
                               hint=f"`moetier train cache-policy --policy {policy} --trace DIR --model M` "
                                    f"writes it")
        return path
