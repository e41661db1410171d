"""The predictor contract (DESIGN.md): a predictor hears each MoE layer's routing and the router's input, and
names, for MoE layers still to come, a score per expert for each token in flight — higher meaning more likely
needed. Plain computation on what it is handed: it opens no file and starts no thread; whatever it learned
offline is loaded elsewhere and handed to it, so the engine and the simulator drive the same object."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the routing is handed in; predictors import nothing above them
    from moetier.plan.route import RouteResult


Predictions = dict[int, np.ndarray]  # future MoE layer -> scores [T, E]


class Predictor:
    """Subclasses override `predict`, and `observe` / `on_sequence_start` if they keep state."""

    name = "base"

    def __init__(self, moe_layers: Sequence[int], num_experts: int, top_k: int, distance: int = 1) -> None:
        """`distance`: how many MoE layers ahead to predict (1 = the next one)."""
        if distance < 1:
            raise ValueError(f"distance must be at least 1, not {distance}")
        self.moe_layers, self.num_experts, self.top_k, self.distance = tuple(moe_layers), num_experts, top_k, distance
        self._index = {layer: i for i, layer in enumerate(self.moe_layers)}

    def future_layers(self, layer: int) -> tuple[int, ...]:
        """The MoE layers 1..distance after `layer` (fewer near the end of the model)."""
        i = self._index[layer]
        return self.moe_layers[i + 1:i + 1 + self.distance]

    def on_sequence_start(self) -> None:
        pass

    def observe(self, layer: int, gate_input, route: RouteResult) -> None:
        """`layer`'s routing of the tokens in flight, and the router's input (a tensor [T, H] in the engine,
        None where there is none, e.g. a trace without gate inputs)."""

    def predict(self, layer: int, gate_input) -> Predictions:
        """After `layer` routed: scores [T, E] for each of `future_layers(layer)`."""
        raise NotImplementedError

    def on_device(self, layer: int, gate_input) -> object | None:
        """What the predictor computes where the router ran, queued before the layer's routing is read back so it
        comes back in the same copy (a tensor [T, n]; `read_back` hands it over as numpy), or None: nothing (the
        default, and always on the CPU, where reading it is free)."""
        return None

    def read_back(self, layer: int, values: np.ndarray) -> None:
        """`on_device`'s values for `layer`, on the host, before `predict(layer, ...)`."""
