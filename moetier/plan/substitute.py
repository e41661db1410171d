"""SMoE's importance-driven substitution (§IV-A/B, Alg. 1, the "expert-cache router"): a planner stage before the
precision and on-demand stages that replaces a token's missing low-score experts by experts that are already at
hand and score almost as well.

Per token, with S_{k+1} its (k+1)-th highest router score:
- a selected expert scoring above (1+α)·S_{k+1} is top-score: it always runs;
- a selected expert scoring at most that is low-score; one that is in the cache (resident or being read), or that
  is some token's top-score expert in this step (batch-aware: it is computed anyway), runs as routed;
- the other low-score ones are replaced, lowest-scoring first, by the best substitutes: experts the token did not
  select, scoring at least (1−α)·S_{k+1}, that are in the cache or (batch-aware) another token's top-score expert.
  Where substitutes run out, the highest-scoring of the remaining low-score experts load.

Choices the paper leaves open, named:
- the substitute's weight: `scaled` (default) gives it its own gate under the routing's normalisation —
  the replaced weight times score(substitute)/score(replaced), which is the substitute's own softmax gate on a
  family that does not renormalise, and its gate over the same top-k denominator on one that does; `inherit` gives
  it the replaced expert's weight (the paper's "the router's results" keep k weights but do not say whose).
- the top-score set C is taken over all of the step's tokens before any is substituted (Alg. 1 builds it token by
  token, which makes the result depend on the tokens' order);
- a substitute may score exactly S_{k+1} (the (k+1)-th expert itself): §IV-A's bound (1−α)S_{k+1} < Score ≤
  S_{k+1}; Alg. 1's strict `< L` would exclude the very expert that ranks next. Its lower end is inclusive as in
  Alg. 1 (`R ≤ score`);
- decode steps only: a prompt's tokens together need nearly every expert (SMoE §VI-B: prefill's activation is
  dense), so substituting there saves almost no read and costs quality. The prompt runs as routed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.residency import Residency
from moetier.errors import MoetierError
from moetier.plan.layer_plan import SKIP, LayerPlan
from moetier.plan.route import DECODE

WEIGHTS = ("scaled", "inherit")
# SMoE §VI-B "in practice": α 0.35 for deepseek-moe-16b (S1), 0.3 for XVERSE-MoE-A4.2B (25.8B, S2), 0.25 for
# Qwen2-57B-A14B (S3): larger models, smaller α. Ours by routed-expert parameters (most of an MoE's: 14.9B, about
# 24B and 49B for those three): up to 20B, up to 40B, beyond.
PAPER_ALPHAS = ((20e9, 0.35), (40e9, 0.3), (float("inf"), 0.25))


def default_alpha(expert_params: float) -> float:
    """The paper's α for a model of `expert_params` routed-expert parameters (PAPER_ALPHAS)."""
    return next(alpha for bound, alpha in PAPER_ALPHAS if expert_params <= bound)


@dataclass(frozen=True)
class Substitution:
    """A run's substitution: `alpha` None takes the model's default (default_alpha); 0 substitutes nothing."""

    alpha: float | None = None
    weight: str = "scaled"
    batch_aware: bool = True

    def __post_init__(self) -> None:
        if self.alpha is not None and not 0.0 <= self.alpha < 1.0:
            raise MoetierError(f"the substitution threshold alpha must be within [0, 1), not {self.alpha}",
                               hint="SMoE uses 0.25-0.35; 0 substitutes nothing")
        if self.weight not in WEIGHTS:
            raise MoetierError(f"unknown substitute weight {self.weight!r}", hint=f"one of {', '.join(WEIGHTS)}")

    def resolved(self, expert_params: float) -> Substitution:
        """With α filled in: the paper's for a model of `expert_params` routed-expert parameters, if not given."""
        return self if self.alpha is not None else dataclasses.replace(self, alpha=default_alpha(expert_params))

    def stage(self, residency: Residency, precision: Precision) -> SubstitutionStage:
        if self.alpha is None:
            raise ValueError("resolve alpha first (Substitution.resolved)")
        return SubstitutionStage(residency, precision, self.alpha, self.weight, self.batch_aware)


class SubstitutionStage:
    name = "substitution"

    def __init__(self, residency: Residency, precision: Precision, alpha: float, weight: str = "scaled",
                 batch_aware: bool = True) -> None:
        Substitution(alpha, weight, batch_aware)  # refuses bad values
        self.residency, self.precision = residency, precision
        self.alpha, self.weight, self.batch_aware = alpha, weight, batch_aware

    def __call__(self, plan: LayerPlan) -> LayerPlan:
        route = plan.route
        ids, scores = plan.assign_ids, route.scores  # [T, k], [T, E]
        k, num_experts = ids.shape[1], scores.shape[1]
        if route.phase != DECODE or self.alpha == 0 or k >= num_experts:
            return plan
        # nothing missing, nothing to replace: most layers once the cache is warm (the rest of the stage, its [E]
        # mask and numpy per token, took ~0.1 ms a layer inside the engine: 5% of a demo-fine-xl step)
        entries = self.residency.entries
        if all(ExpertKey(route.layer, e) in entries for e in plan.experts):
            return plan
        s_next = -np.partition(-scores, k, axis=1)[:, k]  # [T] S_{k+1}
        upper, lower = (1 + self.alpha) * s_next, (1 - self.alpha) * s_next  # [T]
        chosen = np.take_along_axis(scores, np.maximum(ids, 0), axis=1)  # [T, k] the assignment's scores
        top = (chosen > upper[:, None]) & (ids != SKIP)  # [T, k] top-score
        at_hand = self._cached(route.layer, num_experts)  # [E] bool
        if self.batch_aware:
            at_hand[ids[top]] = True  # the step's top-score set C: computed anyway
        new_ids, new_weights = ids.copy(), plan.assign_weights.copy()
        changed = False
        for t in range(len(ids)):  # decode: a few tokens
            changed |= self._token(t, ids[t], chosen[t], top[t], scores[t], lower[t], at_hand, new_ids, new_weights)
        if changed:
            plan.reassign(new_ids, new_weights, self.precision)
        return plan

    def _cached(self, layer: int, num_experts: int) -> np.ndarray:
        """[E]: which of the layer's experts have an entry in the cache (resident, or a read in flight)."""
        entries = self.residency.entries  # E lookups a layer (64 for the demo models): less than a kernel launch
        return np.fromiter((ExpertKey(layer, e) in entries for e in range(num_experts)), dtype=bool,
                           count=num_experts)

    def _token(self, t: int, ids: np.ndarray, chosen: np.ndarray, top: np.ndarray, scores: np.ndarray,
               lower: float, at_hand: np.ndarray, new_ids: np.ndarray, new_weights: np.ndarray) -> bool:
        """Alg. 1's body for token t (its row of each array); writes its substitutes into new_ids/new_weights."""
        valid = ids != SKIP
        missing = np.flatnonzero(valid & ~top & ~at_hand[np.maximum(ids, 0)])  # [m] columns: low-score, not at hand
        if missing.size == 0:
            return False
        candidate = at_hand & (scores >= lower)  # [E]
        candidate[ids[valid]] = False  # not one the token already runs
        subs = np.flatnonzero(candidate)
        if subs.size == 0:
            return False
        subs = subs[np.argsort(-scores[subs], kind="stable")]  # best first
        n = min(missing.size, subs.size)
        replaced = missing[np.argsort(chosen[missing], kind="stable")[:n]]  # the n lowest-scoring low-score ones
        replaced = replaced[np.argsort(-chosen[replaced], kind="stable")]  # best first, paired with the best subs
        for column, e in zip(replaced.tolist(), subs[:n].tolist()):
            new_ids[t, column] = e
            if self.weight == "scaled":
                new_weights[t, column] *= scores[e] / max(float(chosen[column]), 1e-30)
        return True
