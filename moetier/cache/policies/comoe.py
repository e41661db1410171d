"""CoMoE's hybrid eviction score: a weighted sum of the expert's probability of being used next, its recent
frequency and its importance (the gate weight it gets when selected). Until predictors exist the next-use
probability is estimated from recent use (an exponential moving average over the last ~8 steps of its layer);
frequency is a slower average (~64 steps); importance an average of its gate weights when selected."""

from __future__ import annotations

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.scored import ScoredPolicy


class CoMoEPolicy(ScoredPolicy):
    name = "comoe"
    next_use_source = "recent frequency (no predictor yet)"

    def __init__(self, ctx: PolicyContext, weights: tuple[float, float, float] = (0.5, 0.3, 0.2),
                 fast: float = 1 / 8, slow: float = 1 / 64) -> None:
        super().__init__(ctx)
        self.weights, self.fast, self.slow = weights, fast, slow
        zeros = lambda: {layer: np.zeros(ctx.num_experts) for layer in ctx.layers}  # noqa: E731
        self.p_next, self.freq, self.importance = zeros(), zeros(), zeros()

    def on_route(self, route) -> None:
        super().on_route(route)
        used = np.zeros(self.ctx.num_experts)
        used[np.unique(route.topk_ids)] = 1.0
        weight = np.zeros(self.ctx.num_experts)  # mean gate weight of each selected expert in this step
        np.add.at(weight, route.topk_ids.ravel(), route.topk_weights.ravel())
        count = np.bincount(route.topk_ids.ravel(), minlength=self.ctx.num_experts)
        layer = route.layer
        self.p_next[layer] += self.fast * (used - self.p_next[layer])
        self.freq[layer] += self.slow * (used - self.freq[layer])
        sel = count > 0
        self.importance[layer][sel] += self.fast * (weight[sel] / count[sel] - self.importance[layer][sel])

    def priority(self, key: ExpertKey) -> float:
        a, b, c = self.weights
        freq = self.freq[key.layer]
        return (a * self.p_next[key.layer][key.expert] + b * freq[key.expert] / max(freq.max(), 1e-9)
                + c * self.importance[key.layer][key.expert])
