"""The planner's stages in their order, as both executors build them: substitution (SMoE), the precision mode's
(HOBBIT's loader, the low tier), placement (load or compute where the weights live), on-demand, then a prefetch
stage."""

from __future__ import annotations

from moetier.plan.costs import RunningCosts
from moetier.plan.placement import make_placement
from moetier.plan.precision import PrecisionSetup, PrecisionStage
from moetier.plan.prefetch import PrefetchStage
from moetier.plan.prefetchers import layer_stages
from moetier.plan.similar_substitute import SimilarSubstitution
from moetier.plan.substitute import Substitution, SubstitutionStage


def plan_stages(made: PrecisionSetup, substitution: Substitution | SimilarSubstitution | None, prefetch: str,
                predictor, costs: RunningCosts, top_k: int, prefetch_params: dict | None = None,
                placement: str = "none") -> list:
    """A prefetch under a mixed precision mode reads each expert at the precision the mode's loader would choose.
    `substitution`: SMoE's resolved (its α known), CoMoE's similar-expert one (its similarity handed in), or None
    for none (α 0 keeps SMoE's stage, which then changes nothing, for a run whose α is tuned as it goes).
    `placement`: a name of moetier.plan.placement, or "none"."""
    front = [substitution.stage(made.residency, made.high)] if substitution is not None else []
    if prefetch == "smoe" and front and isinstance(front[0], SubstitutionStage):  # SMoE prefetches by the
        # substitution's own α (§IV-C), tuned or not
        prefetch_params = {"alpha": lambda: front[0].alpha, **(prefetch_params or {})}
    if prefetch == "presched":  # Alg. 1 asks Eq. 4 which predicted experts the GPU needs where a CPU lane exists
        prefetch_params = {"cpu_lane": placement != "none", **(prefetch_params or {})}
    tail = layer_stages(made.residency, made.high, prefetch, predictor, costs, top_k, prefetch_params)
    loader = next((s for s in made.stages if isinstance(s, PrecisionStage)), None)
    for stage in tail:
        if isinstance(stage, PrefetchStage):
            stage.loader = loader  # HOBBIT's loader (or low-tier's): prefetch at the precision it would choose
    if placement != "none":
        prefetcher = next((s for s in tail if isinstance(s, PrefetchStage)), None)
        reading = prefetcher.reading if prefetcher is not None else (lambda: 0)  # PreScope's α
        placing = [make_placement(placement, made.residency, costs, reading)]
    else:
        placing = []
    return front + made.stages + placing + tail
