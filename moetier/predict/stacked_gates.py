"""`stacked-gates`: HOBBIT's layer-level predictor (§3.3, Figure 8) — the routers of the next p MoE layers,
stacked into one matrix, applied to the current layer's router input in one product: layer l's hidden state stands in for
layer l+d's (residual streams change slowly from layer to layer). One product of [T, H] by [H, p·E] costs about
what one router does, whatever p is (HOBBIT's Fig. 17a).

Scores are the softmax over each layer's experts: the probability the router would give had it seen this hidden
state (families that score by sigmoid rank the same; only a threshold on the probability would differ)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from moetier.predict.base import Predictions, Predictor


class StackedGatesPredictor(Predictor):
    name = "stacked-gates"

    def __init__(self, moe_layers: Sequence[int], num_experts: int, top_k: int,
                 routers: Mapping[int, torch.Tensor | np.ndarray], distance: int = 1) -> None:
        """routers: each MoE layer's router weight [E, H], as the model holds it (its dtype and device)."""
        super().__init__(moe_layers, num_experts, top_k, distance)
        missing = [layer for layer in self.moe_layers if layer not in routers]
        if missing:
            raise ValueError(f"no router weights for layers {missing}")
        self.stacked: dict[int, torch.Tensor] = {}  # layer -> [p·E, H]: the routers of its future layers
        for layer in self.moe_layers:
            future = self.future_layers(layer)
            if future:
                self.stacked[layer] = torch.cat([torch.as_tensor(routers[f]) for f in future])
        self._read: tuple[int, np.ndarray] | None = None  # (layer, its probabilities [T, p·E]) read back with the route

    def _probs(self, w: torch.Tensor, gate_input) -> torch.Tensor:
        """[T, p·E] float32 where `w` lives: each future layer's softmax over its experts."""
        x = torch.as_tensor(gate_input).to(w.device, w.dtype)  # [T, H] (a trace's are float16)
        logits = torch.nn.functional.linear(x, w).float()  # [T, p·E]: the p routers in one product
        return logits.view(x.shape[0], -1, self.num_experts).softmax(-1).view(x.shape[0], -1)

    def on_device(self, layer: int, gate_input) -> torch.Tensor | None:
        """On a GPU, the probabilities queued beside the router, as HOBBIT computes them (§3.1, ②), to come back
        with the routing: one wait a layer, where reading them after it was a second (the 2026-11-30 H200 profile:
        a blocking copy of its own, ~0.15 ms a layer)."""
        w = self.stacked.get(layer)
        if w is None or gate_input is None or not w.is_cuda:
            return None
        return self._probs(w, gate_input)

    def read_back(self, layer: int, values: np.ndarray) -> None:
        self._read = (layer, values)

    def predict(self, layer: int, gate_input) -> Predictions:
        w = self.stacked.get(layer)
        if w is None or gate_input is None:
            return {}
        read, self._read = self._read, None
        if read is not None and read[0] == layer:
            probs = read[1]
        else:  # (on the CPU, the tensors' own memory; on a GPU without `on_device`, a copy of its own)
            probs = self._probs(w, gate_input).cpu().numpy()
        probs = probs.reshape(probs.shape[0], -1, self.num_experts)  # [T, p, E]
        return {f: probs[:, i] for i, f in enumerate(self.future_layers(layer))}
