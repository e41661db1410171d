"""HOBBIT's multidimensional policy (§3.4, Eq. 3): the keep-priority of a cached expert t is

    p_t = w_lru·R_t/T + w_lfu·F_t/T + w_lhu·H_t/T + w_fld·(1 − ((l_t − l_i + l_n) % l_n) / l_n)

with T the current token number of the sequence, R_t the token number of t's last use, F_t its uses and H_t its
uses at the high precision in this sequence (records reset at each new sequence), l_t its layer, l_i the layer of
the expert being inserted, l_n the number of layers. The lowest is evicted. The weights are fitted by minimising
miss penalty on a calibration trace (`moetier train cache-policy --policy hobbit`), saved with the model
(moetier/policy_files.py) and handed to the policy.

Where we read the paper: a token is a token of the sequence (a prompt's tokens all count, so after a prefill of P
tokens T = P); a use is a layer step that computes the expert (a prefill uses each needed expert once); layers
are numbered by their place among the MoE layers (l_n of them: dense layers hold no experts); l_i is the layer
of the expert the cache is making room for (a prefetch's is a later layer), or the layer being computed before
any insertion. Ties go to the least recently used. R_t, F_t and H_t are arrays over every (layer, expert)
(ArrayScoredPolicy): a victim is a sort of the residents, not a scan."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.arrayed import ArrayScoredPolicy
from moetier.cache.policies.context import PolicyContext
from moetier.errors import MoetierError


@dataclass(frozen=True)
class HobbitWeights:
    lru: float = 0.25
    lfu: float = 0.25
    lhu: float = 0.25
    fld: float = 0.25

    def __post_init__(self) -> None:
        if min(self.lru, self.lfu, self.lhu, self.fld) < 0 or self.lru + self.lfu + self.lhu + self.fld <= 0:
            raise MoetierError(f"HOBBIT weights must be non-negative and not all zero: {self}")


class HobbitPolicy(ArrayScoredPolicy):
    name = "hobbit"

    def __init__(self, ctx: PolicyContext, weights: HobbitWeights) -> None:
        super().__init__(ctx)
        self.weights = weights
        self.tokens = 0  # T: tokens of the current sequence so far, the current step's included
        self.counted_step: int | None = None  # the step whose tokens `tokens` holds last
        self.last_token = np.zeros(self.held.shape, dtype=np.int64)  # [L, E] R_t
        self.uses = np.zeros(self.held.shape, dtype=np.int64)  # [L, E] F_t
        self.high_uses = np.zeros(self.held.shape, dtype=np.int64)  # [L, E] H_t
        self.inserting = ctx.layers[0]  # l_i

    def on_sequence_start(self) -> None:
        self.tokens, self.counted_step = 0, None
        for counts in (self.last_token, self.uses, self.high_uses):
            counts[:] = 0

    def on_route(self, route) -> None:
        super().on_route(route)
        if route.step != self.counted_step:  # a step's layers share its tokens: count them once
            self.counted_step = route.step
            self.tokens += route.topk_ids.shape[0]
        self.inserting = route.layer

    def on_admit(self, key: ExpertKey) -> None:
        self.inserting = key.layer

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        super().on_access(key, precision, step)
        at = self.row[key.layer], key.expert
        self.last_token[at] = self.tokens
        self.uses[at] += 1
        if self.ctx.is_high(precision):
            self.high_uses[at] += 1

    def priority(self, key: ExpertKey) -> float:
        w, t, n = self.weights, max(1, self.tokens), self.ctx.num_layers
        distance = (self.position[key.layer] - self.position[self.inserting] + n) % n
        at = self.row[key.layer], key.expert
        return (w.lru * int(self.last_token[at]) / t + w.lfu * int(self.uses[at]) / t
                + w.lhu * int(self.high_uses[at]) / t + w.fld * (1 - distance / n))

    def priorities(self) -> np.ndarray:
        """[L, E] `priority`'s, the same operations in the same order."""
        w, t, n = self.weights, max(1, self.tokens), self.ctx.num_layers
        distance = self.distances_from(self.inserting)  # [L]
        return (w.lru * self.last_token / t + w.lfu * self.uses / t + w.lhu * self.high_uses / t
                + (w.fld * (1 - distance / n))[:, None])
