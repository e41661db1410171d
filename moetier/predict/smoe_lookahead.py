"""`smoe-lookahead`: SMoE's predictor (§IV-C, Figure 7) — run the next layer's attention (with its KV cache) and
its gate on the hidden state as it stands, and take that gate's scores as the prediction. It is the next layer's
own router on an approximate input, so it is the most accurate guess that needs no training; it costs one
layer's attention. The model runs it (it alone holds the attention and the KV cache) and hands it in as
`lookahead(layer, target) -> logits [T, E]`.

Departure, named: SMoE first computes the shared and the resident experts and looks ahead from the hidden state
they leave; we look ahead at routing, before any expert of the layer runs (where the other predictors run and
where the reads it names can queue right behind the layer's own), so the state lacks this layer's experts
altogether. It reaches the next MoE layer only (SMoE's distance): a layer further needs the experts between."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moetier.predict.base import Predictions, Predictor

Lookahead = Callable[[int, int], torch.Tensor]  # (layer routing now, next MoE layer) -> router logits [T, E]


class SmoeLookaheadPredictor(Predictor):
    name = "smoe-lookahead"

    def __init__(self, moe_layers: Sequence[int], num_experts: int, top_k: int, lookahead: Lookahead,
                 distance: int = 1) -> None:
        super().__init__(moe_layers, num_experts, top_k, distance)
        self.lookahead = lookahead

    def future_layers(self, layer: int) -> tuple[int, ...]:
        return super().future_layers(layer)[:1]  # the next MoE layer, whatever the distance asked

    def predict(self, layer: int, gate_input) -> Predictions:
        future = self.future_layers(layer)
        if not future:
            return {}
        logits = self.lookahead(layer, future[0])  # [T, E]
        # to the host: the planner reads it there (one sync, beside the route's own)
        return {future[0]: logits.float().softmax(-1).cpu().numpy()}
