"""SMoE's substitution stage (Alg. 1, §IV-A/B) as pure logic on hand-made routes."""

import numpy as np
import pytest

from moetier.errors import MoetierError
from moetier.plan.layer_plan import SKIP, LayerPlan
from moetier.plan.on_demand import OnDemandStage
from moetier.plan.route import DECODE, PREFILL, RouteResult
from moetier.plan.substitute import Substitution, SubstitutionStage, default_alpha
from tests.handmade_plan import resident as cache

E = 8


def route(scores, k, phase=DECODE):
    """Top-k of `scores` [T, E] as the router picks them, weights renormalised over the top-k (Mixtral's)."""
    scores = np.asarray(scores, np.float32).reshape(-1, E)
    ids = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(scores, ids, axis=1)
    return RouteResult(0, 1, ids.astype(np.int64), (w / w.sum(1, keepdims=True)).astype(np.float32), scores, phase)


def substitute(r, rt, alpha=0.3, **kw):
    return SubstitutionStage(r, "bf16", alpha, **kw)(LayerPlan.exact(rt, "bf16"))


# scores of one token: experts 0..3 selected (k=4), S_{k+1} = 0.10 (expert 4)
# α = 0.3: top-score above 0.13 (experts 0, 1), low-score 2 (0.125) and 3 (0.11); substitutes at least 0.07
ONE = [0.30, 0.20, 0.125, 0.11, 0.10, 0.08, 0.06, 0.026]


def test_a_missing_low_score_expert_is_replaced_by_the_best_resident_substitute():
    r = cache(4, 5, 6)  # 4 (0.10) and 5 (0.08) qualify; 6 (0.06) is below (1-α)·S_{k+1}
    plan = substitute(r, route(ONE, 4))
    assert plan.assign_ids.tolist() == [[0, 1, 4, 5]]  # 2 -> 4 (the best for the best), 3 -> 5
    assert plan.experts == [0, 1, 4, 5]


def test_top_score_experts_always_run_and_resident_low_score_ones_stay():
    r = cache(3, 4, 5, 6, 7)  # low-score 3 is resident: kept; 2 missing: replaced by 4
    plan = substitute(r, route(ONE, 4))
    assert plan.assign_ids.tolist() == [[0, 1, 4, 3]]
    plan = OnDemandStage(r)(plan)
    assert [ld.expert for ld in plan.loads] == [0, 1]  # the top-score ones load though nothing else would


def test_when_substitutes_run_out_the_best_low_score_experts_load():
    r = cache(4)  # one substitute for two missing low-score experts: the lowest (3) is replaced
    plan = substitute(r, route(ONE, 4))
    assert plan.assign_ids.tolist() == [[0, 1, 2, 4]]


def test_the_substitutes_weight_is_its_own_gate_or_the_replaced_one():
    rt = route(ONE, 4)
    scaled = substitute(cache(4, 5), rt)
    inherit = substitute(cache(4, 5), rt, weight="inherit")
    total = sum(ONE[:4])  # the renormalising denominator of the top-4
    assert scaled.assign_weights[0].tolist() == pytest.approx([0.30 / total, 0.20 / total, 0.10 / total,
                                                               0.08 / total])
    assert inherit.assign_weights[0].tolist() == pytest.approx(rt.topk_weights[0].tolist())


def test_alpha_bounds_both_sides():
    # α = 0.1: low-score below 0.11 — only expert 3 (0.11 is not above (1+α)·0.10); substitutes from 0.09: only 4
    plan = substitute(cache(4, 5), route(ONE, 4), alpha=0.1)
    assert plan.assign_ids.tolist() == [[0, 1, 2, 4]]
    # α = 0: nothing is substituted, and the plan is the exact one
    plan = substitute(cache(4, 5), route(ONE, 4), alpha=0.0)
    assert plan.assign_ids is plan.route.topk_ids


def test_batch_aware_uses_another_tokens_top_score_expert():
    other = [0.10, 0.08, 0.05, 0.02, 0.40, 0.25, 0.06, 0.04]  # token 2's top-score: 4 and 5
    rt = route([ONE, other], 4)
    plan = substitute(cache(), rt)
    assert plan.assign_ids[0].tolist() == [0, 1, 4, 5]  # token 1's missing 2 and 3 -> token 2's 4 and 5
    assert substitute(cache(), rt, batch_aware=False).assign_ids is rt.topk_ids  # nothing at hand
    # a low-score expert another token holds as top-score is kept (computed anyway)
    third = [0.02, 0.03, 0.05, 0.40, 0.20, 0.15, 0.10, 0.05]  # 3 is its top-score
    plan = substitute(cache(4), route([ONE, third], 4))
    assert plan.assign_ids[0].tolist() == [0, 1, 4, 3]


def test_prefill_and_traces_without_scores_run_as_routed():
    rt = route(ONE, 4, phase=PREFILL)
    assert substitute(cache(4, 5), rt).assign_ids is rt.topk_ids
    ids = np.array([[0, 1]]), np.array([[0.6, 0.4]], np.float32)
    scores = np.zeros((1, E), np.float32)
    scores[0, :2] = ids[1]  # a trace's top-k weights and zeros elsewhere: S_{k+1} = 0, every selected one top
    bare = RouteResult(0, 1, ids[0], ids[1], scores)
    assert substitute(cache(2, 3), bare).assign_ids is bare.topk_ids


def test_skipped_assignments_are_left_alone():
    plan = LayerPlan.exact(route(ONE, 4), "bf16")
    plan.reassign(np.array([[0, 1, 2, SKIP]]), np.array([[0.4, 0.3, 0.2, 0.0]], np.float32), "bf16")
    plan = SubstitutionStage(cache(4), "bf16", 0.3)(plan)
    assert plan.assign_ids.tolist() == [[0, 1, 4, SKIP]]


def test_configuration_is_checked_and_alpha_defaults_by_model_size():
    with pytest.raises(MoetierError, match="alpha"):
        Substitution(alpha=1.0)
    with pytest.raises(MoetierError, match="weight"):
        Substitution(weight="mean")
    assert default_alpha(16.4e9) == 0.35 and default_alpha(25.8e9) == 0.3 and default_alpha(57e9) == 0.25


def test_a_layer_whose_experts_are_all_cached_is_left_as_routed_without_building_its_mask(monkeypatch):
    """Every routed expert at hand: nothing is missing, so nothing is looked up beyond them (the [E] mask of
    cached experts and the per-token work cost ~0.1 ms a layer inside the engine, on ~99% of layers at 50%)."""
    rt = route(ONE, 4)
    monkeypatch.setattr(SubstitutionStage, "_cached", lambda *a: pytest.fail("built the layer's mask"))
    plan = substitute(cache(0, 1, 2, 3, 7), rt)
    assert plan.assign_ids is rt.topk_ids and plan.experts == [0, 1, 2, 3]
    monkeypatch.undo()
    assert substitute(cache(0, 1, 3, 4), rt).assign_ids.tolist() == [[0, 1, 4, 3]]  # 2 missing: the stage works
