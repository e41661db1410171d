"""`hot`: a static table of each layer's most used experts (from profiling, as Fiddler, KTransformers and
PreScope's hot table start), the same guess for every token. The floor a learned predictor must beat: routing
that is skewed toward a few experts is predicted well by their popularity alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from moetier.predict.base import Predictions, Predictor


class HotPredictor(Predictor):
    name = "hot"

    def __init__(self, moe_layers: Sequence[int], num_experts: int, top_k: int, counts: Mapping[int, np.ndarray],
                 distance: int = 1) -> None:
        """counts: per MoE layer, how often each expert was selected [E] (e.g. over a recorded trace)."""
        super().__init__(moe_layers, num_experts, top_k, distance)
        missing = [layer for layer in self.moe_layers if layer not in counts]
        if missing:
            raise ValueError(f"no use counts for layers {missing}")
        self.table = {layer: np.asarray(counts[layer], dtype=np.float32) / max(1, int(np.sum(counts[layer])))
                      for layer in self.moe_layers}  # [E] each, shares of the selections

    def predict(self, layer: int, gate_input) -> Predictions:
        tokens = 1 if gate_input is None else gate_input.shape[0]
        return {f: np.broadcast_to(self.table[f], (tokens, self.num_experts)) for f in self.future_layers(layer)}
