"""SMoE's score-based eviction: evict the expert with the lowest mean gate score over the last `window` steps
of its layer, counting the scores of experts that were scored but not selected — an expert the router keeps
rating highly stays even when it narrowly misses the top-k. A step's score is the mean over its tokens.
(Replaying a trace without full scores gives top-k weights with zeros elsewhere; `cache-bench` says so.)"""

from __future__ import annotations

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.scored import ScoredPolicy


class SMoEScorePolicy(ScoredPolicy):
    name = "smoe-score"

    def __init__(self, ctx: PolicyContext, window: int = 16) -> None:
        super().__init__(ctx)
        self.window = window
        self._ring = {layer: np.zeros((window, ctx.num_experts)) for layer in ctx.layers}  # [n, E] per layer
        self._sum = {layer: np.zeros(ctx.num_experts) for layer in ctx.layers}  # [E] sum over the ring
        self._filled = dict.fromkeys(ctx.layers, 0)

    def on_route(self, route) -> None:
        super().on_route(route)
        ring, n = self._ring[route.layer], self._filled[route.layer]
        row = n % self.window
        step_scores = route.scores.mean(axis=0)  # [E]
        self._sum[route.layer] += step_scores - ring[row]
        ring[row] = step_scores
        self._filled[route.layer] = n + 1

    def priority(self, key: ExpertKey) -> float:
        n = min(self._filled[key.layer], self.window)
        return float(self._sum[key.layer][key.expert]) / n if n else 0.0
