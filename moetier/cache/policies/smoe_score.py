"""SMoE's score-based eviction (§IV-B, Eq. 3): evict the expert with the lowest mean gate score over the last
`window` tokens generated, counting the scores of experts that were scored but not selected — an expert the router
keeps rating highly stays even when it narrowly misses the top-k (and stays at hand as a substitute).

As the paper defines it: S_{i,j} is expert i's score at the j-th token generation during decoding, so the window
is per token (a batch step of B tokens enters B rows) and a prompt's prefill does not enter it. Before the first
decode token every score is 0 and ties go to the least recently used. Each layer keeps its own window (its experts'
scores). (Replaying a trace without full scores gives top-k weights with zeros elsewhere; `cache-bench` says so.)
The windows' sums are rows of one array (ArrayScoredPolicy): a victim is a sort of the residents, not a scan."""

from __future__ import annotations

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.arrayed import ArrayScoredPolicy
from moetier.cache.policies.context import PolicyContext


class SMoEScorePolicy(ArrayScoredPolicy):
    name = "smoe-score"

    def __init__(self, ctx: PolicyContext, window: int = 16) -> None:
        super().__init__(ctx)
        if window < 1:
            raise ValueError(f"window must be at least 1 token, not {window}")
        self.window = window
        self._ring = {layer: np.zeros((window, ctx.num_experts)) for layer in ctx.layers}  # [n, E] per layer
        self.sums = np.zeros(self.held.shape)  # [L, E] each layer's sum over its ring
        self.filled = np.zeros(len(ctx.layers), dtype=np.int64)  # [L] tokens entered so far

    def on_sequence_start(self) -> None:
        for layer in self.ctx.layers:  # Eq. 3's j counts a sequence's generations
            self._ring[layer][:] = 0
        self.sums[:] = 0
        self.filled[:] = 0

    def on_route(self, route) -> None:
        super().on_route(route)
        if route.prefill:
            return
        ring, at = self._ring[route.layer], self.row[route.layer]
        for token_scores in route.scores[-self.window:]:  # [E] each; a decode step holds a few tokens
            slot = self.filled[at] % self.window
            self.sums[at] += token_scores - ring[slot]
            ring[slot] = token_scores
            self.filled[at] += 1

    def priority(self, key: ExpertKey) -> float:
        at = self.row[key.layer]
        n = min(int(self.filled[at]), self.window)
        return float(self.sums[at, key.expert]) / n if n else 0.0

    def priorities(self) -> np.ndarray:
        n = np.minimum(self.filled, self.window)[:, None]  # [L, 1]
        return np.where(n > 0, self.sums / np.maximum(n, 1), 0.0)  # [L, E]
