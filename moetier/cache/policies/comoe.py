"""CoMoE's hybrid eviction score (Eq. 38): the expert of highest

    S_evict(e) = (1 − δ)·(1 − p(e)) + δ·(λ / f_recent(e) + (1 − λ) / I(e))

leaves first — p(e) the predictor's probability that e is used when its layer next runs (Eq. 36's output,
heard through on_predict), f_recent its recent access frequency, I(e) its importance (the mean gate weight it
gets when selected). The paper gives no values for δ and λ: 0.5 each here. Without a predictor, p(e) is
estimated from recent use (an exponential moving average over ~8 steps of its layer) and the policy says so
(`next_use_source`). f_recent is a moving average over ~64 steps.

The reciprocals, normalised (a departure): as printed, 1/f_recent reaches 1/ε (1,000 for an expert not used
lately) while (1 − p) is at most 1, so the predictor's term never decides and δ does not weigh what it says. Each
reciprocal is taken instead as x̄/(x + x̄), x̄ the mean of x over the layer's experts: the same order as 1/x (less
used, less important: evicted sooner), within (0, 1] like (1 − p) — 1 for an expert never used, 1/2 for one used
as often as the layer's average — so δ and λ weigh three terms of one scale.

Each layer's scores are kept as an array, made again when what they depend on changes (its routing, a prediction
for it, a new sequence), so choosing a victim sorts the residents' scores in NumPy instead of scoring each resident
in Python: the same victim as ScoredPolicy's scan (highest score, then least recently used, then key order), at a
cost that stays small beside a load (tests/cache/test_comoe_victim.py holds the two to the same choices)."""

from __future__ import annotations

from collections.abc import Container

import numpy as np

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.scored import ScoredPolicy


class CoMoEPolicy(ScoredPolicy):
    name = "comoe"

    def __init__(self, ctx: PolicyContext, delta: float = 0.5, lam: float = 0.5, fast: float = 1 / 8,
                 slow: float = 1 / 64, eps: float = 1e-3) -> None:
        super().__init__(ctx)
        if not (0 <= delta <= 1 and 0 <= lam <= 1):
            raise ValueError(f"delta and lam must be within [0, 1] (got {delta}, {lam})")
        self.delta, self.lam, self.fast, self.slow, self.eps = delta, lam, fast, slow, eps
        zeros = lambda: {layer: np.zeros(ctx.num_experts) for layer in ctx.layers}  # noqa: E731
        self.recent_use, self.freq, self.importance = zeros(), zeros(), zeros()
        self.means = {layer: (eps, eps) for layer in ctx.layers}  # x̄ of freq and importance (at least eps)
        self.predicted: dict[int, np.ndarray] = {}  # layer -> p(e) [E], the latest prediction for it
        # the same, as arrays over every (layer, expert) in execution order, for `victim`
        self.row = {layer: i for i, layer in enumerate(ctx.layers)}
        self.keys = [ExpertKey(layer, e) for layer in ctx.layers for e in range(ctx.num_experts)]
        by_key = {key: i for i, key in enumerate(sorted(self.keys))}
        self.key_rank = np.array([by_key[key] for key in self.keys])  # [L·E] ties' last word: key order
        self.scores = np.stack([self.layer_scores(layer) for layer in ctx.layers])  # [L, E]
        self.used_at = np.zeros((len(ctx.layers), ctx.num_experts), dtype=np.int64)  # [L, E] last_use as an array
        self.held = np.zeros((len(ctx.layers), ctx.num_experts), dtype=bool)  # [L, E] resident

    @property
    def next_use_source(self) -> str:
        return "the predictor" if self.predicted else "recent use (no predictor)"

    def on_sequence_start(self) -> None:
        self.predicted.clear()
        for layer in self.ctx.layers:
            self.scores[self.row[layer]] = self.layer_scores(layer)

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        super().on_access(key, precision, step)
        self.used_at[self.row[key.layer], key.expert] = self.clock

    def on_insert(self, key: ExpertKey) -> None:
        super().on_insert(key)
        self.held[self.row[key.layer], key.expert] = True

    def on_evict(self, key: ExpertKey) -> None:
        super().on_evict(key)
        self.held[self.row[key.layer], key.expert] = False

    def on_route(self, route) -> None:
        super().on_route(route)
        used = np.zeros(self.ctx.num_experts)
        used[np.unique(route.topk_ids)] = 1.0
        weight = np.zeros(self.ctx.num_experts)  # mean gate weight of each selected expert in this step
        np.add.at(weight, route.topk_ids.ravel(), route.topk_weights.ravel())
        count = np.bincount(route.topk_ids.ravel(), minlength=self.ctx.num_experts)
        layer = route.layer
        self.recent_use[layer] += self.fast * (used - self.recent_use[layer])
        self.freq[layer] += self.slow * (used - self.freq[layer])
        sel = count > 0
        self.importance[layer][sel] += self.fast * (weight[sel] / count[sel] - self.importance[layer][sel])
        self.means[layer] = (max(self.eps, float(self.freq[layer].mean())),
                             max(self.eps, float(self.importance[layer].mean())))
        self.scores[self.row[layer]] = self.layer_scores(layer)

    def on_predict(self, predictions) -> None:
        """{layer: scores [T, E]}: each token's scores as a distribution (as Eq. 36's softmax), the most any token
        gives an expert."""
        for layer, scores in predictions.items():
            p = scores / np.maximum(scores.sum(axis=1, keepdims=True), 1e-30)
            self.predicted[layer] = p.max(axis=0)
            self.scores[self.row[layer]] = self.layer_scores(layer)

    def evict_score(self, key: ExpertKey) -> float:
        layer, e = key
        p = self.predicted[layer][e] if layer in self.predicted else self.recent_use[layer][e]
        f_mean, i_mean = self.means[layer]
        rare = f_mean / (self.freq[layer][e] + f_mean)  # 1/f_recent, normalised (see above)
        minor = i_mean / (self.importance[layer][e] + i_mean)  # 1/I, normalised
        return (1 - self.delta) * (1 - p) + self.delta * (self.lam * rare + (1 - self.lam) * minor)

    def layer_scores(self, layer: int) -> np.ndarray:
        """evict_score of each of `layer`'s experts [E], the same operations on arrays (so the same floats)."""
        p = self.predicted[layer] if layer in self.predicted else self.recent_use[layer]
        f_mean, i_mean = self.means[layer]
        rare = f_mean / (self.freq[layer] + f_mean)
        minor = i_mean / (self.importance[layer] + i_mean)
        return (1 - self.delta) * (1 - p) + self.delta * (self.lam * rare + (1 - self.lam) * minor)

    def priority(self, key: ExpertKey) -> float:
        return -self.evict_score(key)

    def victim(self, candidates: Container[ExpertKey]) -> ExpertKey:
        held = np.flatnonzero(self.held)  # [R] the residents, as positions in self.keys
        order = np.lexsort((self.key_rank[held], self.used_at.ravel()[held], -self.scores.ravel()[held]))
        for i in held[order]:
            if self.keys[i] in candidates:
                return self.keys[i]
        raise LookupError("no evictable expert")
