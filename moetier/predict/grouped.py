"""A merged model's predictions (moetier/merge): any predictor's scores over the original experts, each group's
summed into its principal — the merged expert, which keeps the principal's id — and 0 for a merged-away id, as
the merged router (moetier/model/router.py's MergedRouter) sums each group's probabilities. A predictor trained on
the original model, or built on its routers (the variants share them), then names only experts the merged store
holds: without this a prefetch of a merged-away id asked the store for an expert it does not have."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moetier.predict.base import Predictions, Predictor


class GroupedPredictor(Predictor):
    def __init__(self, inner: Predictor, groups: Sequence[Sequence[int]]) -> None:
        """`groups`: per MoE layer of `inner`, each expert's principal [E] (ModelSpec.expert_groups)."""
        super().__init__(inner.moe_layers, inner.num_experts, inner.top_k, inner.distance)
        if len(groups) != len(inner.moe_layers) or any(len(g) != inner.num_experts for g in groups):
            raise ValueError(f"need one group list of {inner.num_experts} ids per MoE layer of the predictor")
        self.inner, self.name = inner, inner.name
        # per layer [E, E]: column p sums the scores of p's group (made once: a product a prediction, no scatter)
        self._sum = {layer: np.eye(inner.num_experts, dtype=np.float32)[:, np.asarray(g)].T.copy()
                     for layer, g in zip(inner.moe_layers, groups)}

    def on_sequence_start(self) -> None:
        self.inner.on_sequence_start()

    def observe(self, layer: int, gate_input, route) -> None:
        self.inner.observe(layer, gate_input, route)

    def predict(self, layer: int, gate_input) -> Predictions:
        return {future: np.asarray(scores, dtype=np.float32) @ self._sum[future]  # [T, E]: each column into its
                for future, scores in self.inner.predict(layer, gate_input).items()}  # principal's


def for_model(predictor: Predictor, expert_groups: Sequence[Sequence[int]]) -> Predictor:
    """`predictor` as a model with `expert_groups` needs it: grouped for a merged model, as it is otherwise."""
    if isinstance(predictor, GroupedPredictor):
        predictor = predictor.inner
    return GroupedPredictor(predictor, expert_groups) if expert_groups else predictor
