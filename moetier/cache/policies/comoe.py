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

What a route changes is absorbed late: `on_route` only keeps a copy of its ids and weights, and a layer's routes
since it was last read are folded into its moving averages at once when a score is asked for (an eviction, not a
hit), in closed form over those routes — an average after n more routes is (1 − a)ⁿ of it plus each route's
use weighted by (1 − a) to the routes after it — where each route cost a dozen array operations (34 µs on a Zen 4,
~1 ms a token of a 32-layer model even with every expert resident). Each layer's scores are kept as an array,
made again when what they depend on has changed (its routing, a prediction for it, a new sequence), so choosing a
victim sorts the residents' scores in NumPy (ArrayScoredPolicy) instead of scoring each resident in Python: the
same victim as ScoredPolicy's scan (highest score, then least recently used, then key order), at a cost that stays
small beside a load (tests/cache/test_array_victim.py holds the two to the same choices, test_comoe_victim.py the
folded averages to the route-by-route ones). A decode step's victims come a layer at a time with nothing between
them that moves the order, so the sort is kept from one to the next (`victim`), and a single stale layer's scores
are made on its own row's views (`row_score`): on the GPU path's host, CoMoE's layer went from 1.33 and 1.16 ms to
1.02 and 0.99 on a Zen 3 (bench/gpu/host_time.py, lru's 0.86 and 0.95 / 0.79 and 0.80 beside them)."""

from __future__ import annotations

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.arrayed import ArrayScoredPolicy
from moetier.cache.policies.context import PolicyContext


class CoMoEPolicy(ArrayScoredPolicy):
    name = "comoe"
    # a layer's routes kept unabsorbed at most, and their ids: memory stays bounded (~48 KiB a layer) where nothing
    # is evicted, a long prompt's routes absorbed at once
    held_routes, held_ids = 256, 4096

    def __init__(self, ctx: PolicyContext, delta: float = 0.5, lam: float = 0.5, fast: float = 1 / 8,
                 slow: float = 1 / 64, eps: float = 1e-3) -> None:
        super().__init__(ctx)
        if not (0 <= delta <= 1 and 0 <= lam <= 1):
            raise ValueError(f"delta and lam must be within [0, 1] (got {delta}, {lam})")
        self.delta, self.lam, self.fast, self.slow, self.eps = delta, lam, fast, slow, eps
        shape = (len(ctx.layers), ctx.num_experts)  # [L, E], rows in execution order
        self.recent_use, self.freq, self.importance = np.zeros(shape), np.zeros(shape), np.zeros(shape)
        self.routes: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in ctx.layers]  # not yet absorbed
        self.ids_held = [0] * len(ctx.layers)  # their ids, a row's
        self.predicted: dict[int, np.ndarray] = {}  # layer -> p(e) [E], the latest prediction for it
        self.scores = np.zeros(shape)  # [L, E] Eq. 38's, but in the rows of `stale`
        self.stale = set(range(len(ctx.layers)))  # rows whose scores must be made again
        # the residents in victim order (positions in self.keys), kept from one victim to the next while nothing
        # that orders them moves: the scores (a row stale), a last use (on_access); and the keys inserted since
        self._ranked: list[int] | None = None
        self._joined: list[ExpertKey] = []

    def on_access(self, key: ExpertKey, precision, step: int) -> None:
        super().on_access(key, precision, step)
        self._ranked = None

    def on_insert(self, key: ExpertKey) -> None:
        super().on_insert(key)
        self._joined.append(key)

    def victim(self, candidates) -> ExpertKey:
        """ArrayScoredPolicy's victim, its sort kept for the layer's next ones: a decode step's misses evict one
        after another with nothing between them that moves an order — an eviction only leaves it, and a key
        inserted meanwhile (a load this layer waits for) is no candidate; where one is, the residents are sorted
        again. The same victim as the sort each time (tests/cache/test_array_victim.py)."""
        if self.stale or self._ranked is None or any(key in candidates for key in self._joined):
            priorities = self.priorities()  # (fresh: the stale rows made again)
            held = np.flatnonzero(self.held)  # [R]
            order = np.lexsort((self.key_rank[held], self.used_at.ravel()[held], priorities.ravel()[held]))
            self._ranked, self._joined = held[order].tolist(), []
        held, keys = self.held.ravel(), self.keys
        for i in self._ranked:
            if held[i] and keys[i] in candidates:
                return keys[i]
        raise LookupError("no evictable expert")

    @property
    def next_use_source(self) -> str:
        return "the predictor" if self.predicted else "recent use (no predictor)"

    def on_sequence_start(self) -> None:
        self.predicted.clear()
        self.stale.update(range(len(self.ctx.layers)))

    def on_route(self, route) -> None:
        super().on_route(route)
        row = self.row[route.layer]
        routes = self.routes[row]
        routes.append((route.topk_ids.reshape(-1).copy(), route.topk_weights.reshape(-1).copy()))  # [T·k] each
        self.stale.add(row)
        self.ids_held[row] += route.topk_ids.size
        if len(routes) >= self.held_routes or self.ids_held[row] >= self.held_ids:
            self.absorb(row)

    def absorb(self, row: int) -> None:
        """Fold row's held routes into its moving averages, as route after route would have: each average after
        n routes is (1 − a)ⁿ of what it was plus a·(1 − a)^(routes after j)·(what route j gave it), an expert's
        importance counting only the routes that selected it."""
        routes = self.routes[row]
        if not routes:
            return
        if self.one_token(row):
            self.absorb_token(row)
            return
        n, E = len(routes), self.ctx.num_experts
        ids = np.concatenate([ids for ids, _ in routes])
        flat = ids + np.repeat(np.arange(n) * E, [len(ids) for ids, _ in routes])  # route j's expert e at j·E + e
        count = np.bincount(flat, minlength=n * E).reshape(n, E)  # [n, E] tokens selecting e in route j
        weight = np.bincount(flat, np.concatenate([w for _, w in routes]), n * E).reshape(n, E)  # their gates' sum
        used = (count > 0).astype(np.float64)  # [n, E]
        after = np.arange(n - 1, -1, -1)  # [n] routes after route j
        for avg, a in ((self.recent_use, self.fast), (self.freq, self.slow)):
            avg[row] = (1 - a) ** n * avg[row] + (a * (1 - a) ** after) @ used
        selected_after = used[::-1].cumsum(axis=0)[::-1] - used  # [n, E] later routes selecting e
        mean_weight = weight / np.maximum(count, 1)  # [n, E] the mean gate e got in route j
        kept = (1 - self.fast) ** used.sum(axis=0)  # [E]
        self.importance[row] = kept * self.importance[row] + (
            used * self.fast * (1 - self.fast) ** selected_after * mean_weight).sum(axis=0)
        routes.clear()
        self.ids_held[row] = 0

    def one_token(self, row: int) -> bool:
        """Whether row holds one route of one token (a decode step at batch 1: k distinct ids)."""
        routes = self.routes[row]
        return len(routes) == 1 and len(routes[0][0]) == self.ctx.top_k

    def absorb_one_token(self, rows: np.ndarray) -> None:
        """`absorb` for rows that each hold one_token's route, all at once: the same averages in a few operations."""
        E, k = self.ctx.num_experts, self.ctx.top_k
        flat = np.concatenate([self.routes[row][0][0] for row in rows]) + np.repeat(rows * E, k)  # [R·k] into [L·E]
        weights = np.concatenate([self.routes[row][0][1] for row in rows])  # [R·k]
        for avg, a in ((self.recent_use, self.fast), (self.freq, self.slow)):
            avg[rows] *= 1 - a
            avg.ravel()[flat] += a  # a row's k ids are distinct, so += adds once each
        importance = self.importance.ravel()
        importance[flat] += self.fast * (weights - importance[flat])
        for row in rows:
            self.routes[row].clear()
            self.ids_held[row] = 0

    def absorb_token(self, row: int) -> None:
        """`absorb_one_token` for one row, on its views: the same operations (so the same floats) without the
        gathering a batch of rows needs — a decode step's one routed layer a victim is chosen after."""
        ids, weights = self.routes[row][0]  # [k] each, distinct ids
        for avg, a in ((self.recent_use, self.fast), (self.freq, self.slow)):
            avg_row = avg[row]
            avg_row *= 1 - a
            avg_row[ids] += a
        importance = self.importance[row]
        importance[ids] += self.fast * (weights - importance[ids])
        self.routes[row].clear()
        self.ids_held[row] = 0

    def on_predict(self, predictions) -> None:
        """{layer: scores [T, E]}: each token's scores as a distribution (as Eq. 36's softmax), the most any token
        gives an expert."""
        for layer, scores in predictions.items():
            p = scores / np.maximum(scores.sum(axis=1, keepdims=True), 1e-30)
            self.predicted[layer] = p.max(axis=0).astype(np.float64)  # as the averages: one dtype, the same floats
            self.stale.add(self.row[layer])

    def terms(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`layer`'s p(e), f_recent and I [E] each, its routes absorbed."""
        row = self.row[layer]
        self.absorb(row)
        p = self.predicted[layer] if layer in self.predicted else self.recent_use[row]
        return p, self.freq[row], self.importance[row]

    def evict_score(self, key: ExpertKey) -> float:
        p, freq, importance = self.terms(key.layer)
        E = self.ctx.num_experts
        f_mean, i_mean = max(float(freq.sum()) / E, self.eps), max(float(importance.sum()) / E, self.eps)
        return self.eq38(p[key.expert], freq[key.expert], importance[key.expert], f_mean, i_mean)

    def eq38(self, p, freq, importance, f_mean, i_mean):
        """Eq. 38 from its terms, scalars or arrays alike (one expression: the same floats for evict_score,
        row_scores and row_score), the reciprocals normalised by the layer's means (see above)."""
        rare = f_mean / (freq + f_mean)  # 1/f_recent, normalised
        minor = i_mean / (importance + i_mean)  # 1/I, normalised
        return (1 - self.delta) * (1 - p) + self.delta * (self.lam * rare + (1 - self.lam) * minor)

    def row_scores(self, rows: np.ndarray) -> np.ndarray:
        """evict_score of each expert of each of rows' layers [R, E], their routes absorbed: the same operations on
        arrays (so the same floats)."""
        E = self.ctx.num_experts
        p = self.recent_use[rows]  # [R, E]
        if self.predicted:
            for i, row in enumerate(rows):
                p[i] = self.predicted.get(self.ctx.layers[row], p[i])
        freq, importance = self.freq[rows], self.importance[rows]
        f_mean = np.maximum(freq.sum(axis=1, keepdims=True) / E, self.eps)  # [R, 1] the mean, as evict_score's
        i_mean = np.maximum(importance.sum(axis=1, keepdims=True) / E, self.eps)
        return self.eq38(p, freq, importance, f_mean, i_mean)

    def row_score(self, row: int) -> np.ndarray:
        """`row_scores` of one row [E], on its views (evict_score's operations, so the same floats)."""
        E = self.ctx.num_experts
        p = self.predicted.get(self.ctx.layers[row], self.recent_use[row])  # [E]
        freq, importance = self.freq[row], self.importance[row]
        f_mean, i_mean = max(freq.sum() / E, self.eps), max(importance.sum() / E, self.eps)
        return self.eq38(p, freq, importance, f_mean, i_mean)

    def fresh_scores(self) -> np.ndarray:
        """[L, E] every layer's Eq. 38 scores, those made stale since made again — together, so a token's layers
        cost a few array operations, not a few each; one stale row (a decode step's victims come a layer at a
        time) on its own views, a third of the gathered rows' cost."""
        if len(self.stale) == 1:
            row = self.stale.pop()
            self.absorb(row)
            self.scores[row] = self.row_score(row)
        elif self.stale:
            rows = np.fromiter(self.stale, np.int64, len(self.stale))
            single = np.array([row for row in rows if self.one_token(row)], np.int64)
            if len(single):
                self.absorb_one_token(single)
            for row in rows:
                self.absorb(row)  # the rest
            self.scores[rows] = self.row_scores(rows)
            self.stale.clear()
        return self.scores

    def priority(self, key: ExpertKey) -> float:
        return -self.evict_score(key)

    def priorities(self) -> np.ndarray:
        return -self.fresh_scores()
