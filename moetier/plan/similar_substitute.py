"""CoMoE's error correction for mispredicted experts (§III-D): a token's expert that the prediction missed — not in
the cache and not being read — is loaded at once if it matters to the token, and otherwise replaced by the most
similar expert of its layer already at hand, "leveraging expert similarity to reduce the frequency of costly data
transfers". A planner stage in the substitution's place (plan/pipeline.py), on decode steps.

The paper names the signals — popularity, importance, similarity — but not the rule; here, named:
- a missing expert is of *high priority* (read now) when it is the token's first expert, or its routing weight is at
  least `share` times an even share of the token's weights (1/k: `share` = 1); otherwise *low* (importance; a
  popular expert is what CoMoE's Eq. 38 eviction keeps cached, so popularity acts through the cache, not here);
- its substitute is the at-hand expert (cached, or being read) of highest similarity to it that the token did not
  select, if that similarity is at least `min_similarity`; else it is read. Similarity is Eq. 27's α·S_param +
  (1 − α)·S_func, the measure merging groups by, computed once per model from a calibration trace (`moetier train
  similarity`, saved in the model's policies/similarity.json);
- the substitute takes the replaced expert's routing weight (it stands in for it; the router's weights are kept);
- decode steps only, as SMoE's substitution (a prompt's tokens need nearly every expert together)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.residency import Residency
from moetier.errors import MoetierError
from moetier.plan.layer_plan import SKIP, LayerPlan
from moetier.plan.route import DECODE


@dataclass(frozen=True)
class SimilarSubstitution:
    """A run's similar-expert substitution; `similarity` (per MoE layer [E, E]) is the model's, handed in by the
    engine (load_similarity) or the simulator before its stage is made."""

    min_similarity: float = 0.5
    share: float = 1.0
    similarity: Mapping[int, np.ndarray] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not -1.0 <= self.min_similarity <= 1.0:
            raise MoetierError(f"the least similarity a substitute needs must be within [-1, 1], not "
                               f"{self.min_similarity}")
        if self.share < 0:
            raise MoetierError(f"the importance share must be >= 0, not {self.share}")

    def resolved(self, expert_params: float) -> SimilarSubstitution:
        return self  # (nothing to fill in from the model's size)

    def stage(self, residency: Residency, precision: Precision) -> SimilarSubstitutionStage:
        if self.similarity is None:
            raise ValueError("hand the model's similarity in first (SimilarSubstitution(similarity=...))")
        return SimilarSubstitutionStage(residency, precision, self.similarity, self.min_similarity, self.share)


class SimilarSubstitutionStage:
    name = "similar-substitution"

    def __init__(self, residency: Residency, precision: Precision, similarity: Mapping[int, np.ndarray],
                 min_similarity: float = 0.5, share: float = 1.0) -> None:
        self.residency, self.precision = residency, precision
        self.similarity, self.min_similarity, self.share = similarity, min_similarity, share

    def __call__(self, plan: LayerPlan) -> LayerPlan:
        route = plan.route
        sim = self.similarity.get(route.layer)
        if route.phase != DECODE or sim is None:
            return plan
        entries = self.residency.entries
        if all(ExpertKey(route.layer, e) in entries for e in plan.experts):  # nothing missing: most layers
            return plan
        ids, weights = plan.assign_ids, plan.assign_weights  # [T, k] each
        at_hand = np.fromiter((ExpertKey(route.layer, e) in entries for e in range(sim.shape[0])), dtype=bool,
                              count=sim.shape[0])  # [E]
        new_ids, changed = ids.copy(), False
        for t in range(len(ids)):  # decode: a few tokens
            changed |= self._token(ids[t], np.asarray(weights[t], dtype=np.float32), sim, at_hand, new_ids[t])
        if changed:
            plan.reassign(new_ids, plan.assign_weights.copy(), self.precision)
        return plan

    def _token(self, ids: np.ndarray, weights: np.ndarray, sim: np.ndarray, at_hand: np.ndarray,
               out: np.ndarray) -> bool:
        """One token's row: its low-priority missing experts replaced in `out` by similar ones at hand."""
        valid = np.flatnonzero(ids != SKIP)
        if valid.size < 2:
            return False
        w = weights[valid]
        bar = self.share * float(w.sum()) / valid.size  # an even share of the token's weight, scaled
        first = valid[int(np.argmax(w))]
        changed = False
        for c in valid.tolist():
            e = int(ids[c])
            if c == first or at_hand[e] or weights[c] >= bar:
                continue  # high priority, or nothing to read
            candidates = at_hand.copy()
            candidates[out[valid]] = False  # not one the token runs already
            if not candidates.any():
                return changed
            best = int(np.argmax(np.where(candidates, sim[e], -np.inf)))
            if sim[e, best] >= self.min_similarity:
                out[c] = best
                changed = True
        return changed
