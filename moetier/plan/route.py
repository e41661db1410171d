"""One layer's routing decision for the tokens in flight, as policies and planners see it (NumPy views)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PREFILL, DECODE = 0, 1  # the phase of a forward step: a prompt's tokens together, or one new token per sequence


@dataclass(frozen=True)
class RouteResult:
    layer: int
    step: int
    topk_ids: np.ndarray  # [T, k] int64
    topk_weights: np.ndarray  # [T, k] float32
    scores: np.ndarray  # [T, E] float32, after the family's scoring function (softmax)
    phase: int = DECODE  # the step's: PREFILL or DECODE

    @property
    def prefill(self) -> bool:
        """A prompt's step (policies hear routes without importing this module)."""
        return self.phase == PREFILL
