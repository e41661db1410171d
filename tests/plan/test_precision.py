"""HOBBIT's precision stage (§3.2, Eq. 2) and the low tier, as pure logic on hand-made routes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.cache.keys import ExpertKey
from moetier.cache.policies import LRUPolicy
from moetier.cache.residency import Residency
from moetier.errors import MoetierError
from moetier.plan.layer_plan import RESIDENT, SKIP, LayerPlan
from moetier.plan.on_demand import OnDemandStage
from moetier.plan.precision import (
    HIGH,
    LOW,
    SKIPPED,
    AsHeldPrecisionStage,
    LowTierStage,
    MixedPrecision,
    PrecisionStage,
    fit_thresholds,
    levels,
    row_levels,
)
from moetier.plan.route import RouteResult


def route(ids, weights, layer=0, num_experts=8):
    ids, weights = np.asarray(ids, dtype=np.int64), np.asarray(weights, dtype=np.float32)
    return RouteResult(layer, 1, ids, weights, np.zeros((ids.shape[0], num_experts), np.float32))


def test_levels_follow_equation_2():
    # gates 0.5, 0.3, 0.15, 0.05 (given out of order): s = 0, 0.5, 0.8, 0.95
    w = np.array([[0.15, 0.5, 0.05, 0.3]])
    assert levels(w, 0.6, 0.9).tolist() == [[LOW, HIGH, SKIPPED, HIGH]]
    # unnormalised router weights are normalised first: the same answer
    assert levels(w * 0.37, 0.6, 0.9).tolist() == [[LOW, HIGH, SKIPPED, HIGH]]
    # the first expert is high even when T1 = 0
    assert levels(w, 0.0, 0.0).tolist() == [[SKIPPED, HIGH, SKIPPED, SKIPPED]]


def residency(capacity=100, **shares):
    return Residency(capacity, {"bf16": 10, "int4": 3}, LRUPolicy(), shares=shares or None)


def test_misses_get_their_precision_and_the_least_important_are_skipped():
    r = residency()
    plan = LayerPlan.exact(route([[1, 2, 3, 4]], [[0.5, 0.3, 0.15, 0.05]]), "bf16")
    plan = PrecisionStage(r, "bf16", "int4", 0.6, 0.9)(plan)
    assert plan.precision == {1: "bf16", 2: "bf16", 3: "int4"}
    assert plan.assign_ids.tolist() == [[1, 2, 3, SKIP]] and plan.assign_weights[0, 3] == 0
    plan = OnDemandStage(r)(plan)
    assert [(ld.expert, ld.precision) for ld in plan.loads] == [(1, "bf16"), (2, "bf16"), (3, "int4")]


def cached(r, held: dict, landed: bool = True):
    for e, p in held.items():
        r.admit(ExpertKey(0, e), p)
        if landed:
            r.landed(ExpertKey(0, e))
    r.unpin_all()


def test_as_held_a_cached_copy_of_any_precision_is_used_as_it_is():
    r = residency()
    cached(r, {1: "int4", 4: "bf16"})
    plan = LayerPlan.exact(route([[1, 2, 3, 4]], [[0.5, 0.3, 0.15, 0.05]]), "bf16")
    plan = OnDemandStage(r)(AsHeldPrecisionStage(r, "bf16", "int4", 0.6, 0.9)(plan))
    assert plan.assign_ids.tolist() == [[1, 2, 3, 4]]  # expert 4 would be skipped, but it is resident
    assert {run.expert: (run.precision, run.source) for run in plan.runs} == {
        1: ("int4", RESIDENT), 4: ("bf16", RESIDENT), 2: ("bf16", "load"), 3: ("int4", "load")}


def test_by_gate_a_cached_low_copy_of_an_important_expert_is_a_miss_at_high_precision():
    """§3.2: the first expert always high, and each expert's precision from its gate whether cached or not — a
    low copy serves only a low need; a high copy serves any."""
    r = residency()
    cached(r, {1: "int4", 2: "int4", 3: "bf16", 4: "int4"})  # 1 first, 2 important, 3 low, 4 would be skipped
    plan = LayerPlan.exact(route([[1, 2, 3, 4]], [[0.5, 0.3, 0.15, 0.05]]), "bf16")
    plan = OnDemandStage(r)(PrecisionStage(r, "bf16", "int4", 0.6, 0.9)(plan))
    assert {run.expert: (run.precision, run.source) for run in plan.runs} == {
        3: ("bf16", RESIDENT), 4: ("int4", RESIDENT), 1: ("bf16", "load"), 2: ("bf16", "load")}
    assert [(ld.expert, ld.precision) for ld in plan.loads] == [(1, "bf16"), (2, "bf16")]
    assert {k.expert: e.precision for k, e in r.entries.items()} == {1: "bf16", 2: "bf16", 3: "bf16", 4: "int4"}
    assert r.used_bytes == 3 * 10 + 3  # the two low copies left


def test_by_gate_a_low_copy_still_reading_runs_low():
    """A read in flight is never interrupted: the important expert waits for its low copy (one layer's loss)."""
    r = residency()
    cached(r, {1: "int4"}, landed=False)
    plan = LayerPlan.exact(route([[1, 2]], [[0.55, 0.45]]), "bf16")  # both important
    plan = OnDemandStage(r)(PrecisionStage(r, "bf16", "int4", 0.6, 0.9)(plan))
    assert {run.expert: (run.precision, run.source) for run in plan.runs} == {1: ("int4", "in-flight"),
                                                                              2: ("bf16", "load")}


def test_by_gate_the_first_expert_is_high_over_a_top_8_of_low_copies():
    """A top-8 model with its thresholds at 0: only the first expert is important — of eight cached low copies only
    its copy is read again."""
    r = Residency(1000, {"bf16": 10, "int4": 3}, LRUPolicy())
    cached(r, {e: "int4" for e in range(8)})
    weights = [[0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.05]]
    plan = LayerPlan.exact(route([[5, 0, 1, 2, 3, 4, 6, 7]], weights), "bf16")
    plan = OnDemandStage(r)(PrecisionStage(r, "bf16", "int4", 0.0, 1.0)(plan))
    assert [(ld.expert, ld.precision) for ld in plan.loads] == [(5, "bf16")]
    assert sorted(run.expert for run in plan.runs if run.precision == "int4") == [0, 1, 2, 3, 4, 6, 7]


def test_a_layer_whose_experts_are_all_cached_is_left_as_routed():
    r = residency()
    for e in (1, 2, 3, 4):  # expert 4 would be skipped and 3 loaded low, were they missing
        r.admit(ExpertKey(0, e), "bf16")
        r.landed(ExpertKey(0, e))
    r.unpin_all()
    plan = LayerPlan.exact(route([[1, 2, 3, 4]], [[0.5, 0.3, 0.15, 0.05]]), "bf16")
    plan = PrecisionStage(r, "bf16", "int4", 0.6, 0.9)(plan)
    assert plan.assign_ids.tolist() == [[1, 2, 3, 4]] and plan.assign_weights[0, 3] > 0
    assert plan.precision == {1: "bf16", 2: "bf16", 3: "bf16", 4: "bf16"}


def test_an_expert_is_skipped_only_if_every_token_would_skip_it():
    r = residency()
    plan = LayerPlan.exact(route([[1, 2, 3, 4], [4, 3, 2, 1]], [[0.5, 0.3, 0.15, 0.05]] * 2), "bf16")
    plan = PrecisionStage(r, "bf16", "int4", 0.6, 0.9)(plan)
    assert (plan.assign_ids != SKIP).all()  # 4 is important for the second token, 1 for the first
    assert plan.precision == {1: "bf16", 2: "bf16", 3: "bf16", 4: "bf16"}


def test_sub_caches_evict_within_their_precision():
    r = residency(capacity=40, bf16=0.5, int4=0.5)  # 20 bytes each: two bf16, six int4
    assert r.slots("bf16") == 2 and r.slots("int4") == 6
    for e in range(6):
        assert r.admit(ExpertKey(0, e), "int4")[1] == ()
        r.landed(ExpertKey(0, e))
    r.unpin_all()
    slot, evicted = r.admit(ExpertKey(0, 6), "bf16")
    assert evicted == ()  # the high sub-cache is empty: nothing of the low one leaves
    r.landed(ExpertKey(0, 6))
    r.unpin_all()
    _, evicted = r.admit(ExpertKey(0, 7), "int4")
    assert evicted == (ExpertKey(0, 0),)  # the low sub-cache's least recent
    with pytest.raises(ValueError, match="by layer or by precision"):
        Residency(40, {"bf16": 10}, LRUPolicy(), layers=(0,), shares={"bf16": 1.0})


def test_the_low_tier_serves_unimportant_misses_without_a_read():
    r = Residency(100, {"bf16": 10}, LRUPolicy())
    plan = LayerPlan.exact(route([[5, 6]], [[0.7, 0.3]], layer=3), "bf16")
    plan = PrecisionStage(r, "bf16", "int2", 0.6, 1.0)(plan)
    tier = LowTierStage(r, "int2", [(layer, e) for layer in (1, 3) for e in range(8)])
    plan = OnDemandStage(r)(tier(plan))
    assert [(ld.expert, ld.precision) for ld in plan.loads] == [(5, "bf16")]
    assert [(run.expert, run.precision, run.slot, run.source) for run in plan.runs if run.precision == "int2"] == [
        (6, "int2", 1 * 8 + 6, RESIDENT)]
    # a merged model's tier holds only its experts: the slot is the expert's place among them
    merged = LowTierStage(r, "int2", [(1, 0), (1, 4), (3, 2), (3, 6)])
    assert (merged.slot(1, 4), merged.slot(3, 6)) == (1, 3)


@pytest.mark.parametrize("kw, match", [({"mode": "fp8"}, "unknown precision mode"),
                                       ({"mode": "hobbit", "t1": 0.9, "t2": 0.5}, "0 <= T1 <= T2"),
                                       ({"mode": "hobbit", "low": "int3"}, "unknown low precision"),
                                       ({"mode": "hobbit", "high_share": 0}, "high_share"),
                                       ({"mode": "hobbit", "cached": "always"}, "unknown cached-copy rule")])
def test_bad_configurations_are_refused(kw, match):
    with pytest.raises(MoetierError, match=match):
        MixedPrecision(**kw)


@pytest.mark.parametrize("cached, stage", [("by-gate", PrecisionStage), ("as-held", AsHeldPrecisionStage)])
def test_the_cached_copy_rule_picks_the_loader(cached, stage):
    from moetier.plan.precision import setup

    made = setup(MixedPrecision("hobbit", cached=cached), "bf16", {"bf16": 10, "int4": 3}, 100, LRUPolicy(), (0,), 8, 2)
    assert type(made.stages[0]) is stage


def test_low_tier_does_not_skip_unless_asked():
    assert MixedPrecision("low-tier").with_thresholds((0.5, 0.7)).t2 == 1.0
    assert MixedPrecision("hobbit").with_thresholds().t2 == 0.9  # the paper's, without a fitted default
    assert MixedPrecision("low-tier", t2=0.95).with_thresholds().t2 == 0.95


def test_thresholds_given_win_over_fitted_ones_and_fitted_over_the_papers():
    assert MixedPrecision("hobbit", t1=0.3).with_thresholds((0.2, 0.5)) == MixedPrecision("hobbit", t1=0.3, t2=0.5)
    assert MixedPrecision("hobbit").with_thresholds() == MixedPrecision("hobbit", t1=0.6, t2=0.9)


def test_fitted_thresholds_reproduce_the_shares():
    rng = np.random.default_rng(0)
    w = rng.dirichlet(np.full(8, 0.7), size=4000)  # [N, 8] routing weights of a top-8 model
    t1, t2 = fit_thresholds(w, (0.6, 0.3, 0.1))
    shares = [float((levels(w, t1, t2) == i).mean()) for i in (HIGH, LOW, SKIPPED)]
    assert shares == pytest.approx([0.6, 0.3, 0.1], abs=0.01)
    assert fit_thresholds(np.ones((5, 1))) == (0.6, 0.9)  # top-1: nothing to fit


def test_the_loader_names_the_precision_of_predicted_experts():
    """HOBBIT §3.3: a predicted expert is prefetched at the precision the loader would choose from the predicted
    gates (Eq. 2 on each token's predicted top-k), or not at all where it would skip it."""
    loader = PrecisionStage(residency(), "bf16", "int4", 0.6, 0.9)
    scores = np.array([[0.50, 0.30, 0.15, 0.05, 0, 0, 0, 0]], np.float32)  # top-4: s = 0, 0.5, 0.8, 0.95
    assert loader.predicted(scores, 4) == {0: "bf16", 1: "bf16", 2: "int4", 3: None}
    # a second token for which expert 3 matters most: its best use wins
    two = np.vstack([scores, [[0.05, 0.15, 0.30, 0.50, 0, 0, 0, 0]]]).astype(np.float32)
    assert loader.predicted(two, 4) == {0: "bf16", 1: "bf16", 2: "bf16", 3: "bf16"}


def test_hobbit_prefetches_at_the_loaders_precision_into_each_sub_cache():
    from moetier.plan.prefetchers import HobbitPrefetch

    r = residency(200, bf16=0.75, int4=0.25)
    loader = PrecisionStage(r, "bf16", "int4", 0.6, 0.9)
    stage = HobbitPrefetch(r, "bf16")
    stage.loader = loader
    plan = OnDemandStage(r)(loader(LayerPlan.exact(route([[4, 5]], [[0.9, 0.1]]), "bf16")))
    plan.predictions = {1: np.array([[0.50, 0.30, 0.15, 0.05, 0, 0, 0, 0]], np.float32)}
    plan.route = RouteResult(0, 1, np.array([[4, 5, 6, 7]]), np.ones((1, 4), np.float32), np.zeros((1, 8), np.float32))
    stage(plan)
    assert [(p.key.expert, p.precision) for p in plan.prefetches] == [(0, "bf16"), (1, "bf16"), (2, "int4")]
    assert all(r.part_of(p.key, p.precision) == p.precision for p in plan.prefetches)  # each in its own sub-cache
    # without the loader, every predicted expert is read at the high precision
    r2 = residency(200, bf16=0.75, int4=0.25)
    plain = HobbitPrefetch(r2, "bf16")
    plan2 = OnDemandStage(r2)(LayerPlan.exact(route([[4, 5]], [[0.9, 0.1]]), "bf16"))
    plan2.predictions, plan2.route = plan.predictions, plan.route
    plain(plan2)
    assert {p.precision for p in plan2.prefetches} == {"bf16"} and len(plan2.prefetches) == 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 5), st.floats(0.0, 1.0)), min_size=1, max_size=8),
       st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_one_tokens_levels_are_what_every_tokens_path_names(pairs, t1, t2):
    """Decode at batch 1 takes a row's levels in Python (three numpy calls an expert cost ~0.1 ms a layer): the same
    experts at the same levels as the general path (here on the row twice: min over a repeat is the row's own),
    a repeated expert (a substitution's) at its most important, SKIP named by none."""
    stage = PrecisionStage(Residency(1, {"bf16": 1}, LRUPolicy()), "bf16", "int4", min(t1, t2), max(t1, t2))
    ids = np.array([[e for e, _ in pairs]], dtype=np.int64)
    weights = np.array([[w for _, w in pairs]], dtype=np.float32)
    got = stage.best_levels(ids, weights)
    assert got == stage.best_levels(np.vstack([ids, ids]), np.vstack([weights, weights]))
    assert list(got) == sorted(got) and SKIP not in got


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(-1.0, 1.0, width=32), min_size=1, max_size=8), st.floats(0.0, 1.0), st.floats(0.0, 1.0),
       st.booleans())
def test_a_rows_levels_in_python_are_numpys_level_for_level(weights, t1, t2, tied):
    """row_levels (batch 1's path) against levels on the same row: the same level for every expert, ties in the
    gates (repeated weights) and a threshold a running sum lands on exactly included."""
    if tied:
        weights = weights[:1] * len(weights)
    row = np.array([weights], dtype=np.float32)
    want = levels(row, min(t1, t2), max(t1, t2))[0].tolist()
    assert row_levels(row, min(t1, t2), max(t1, t2)) == want
    w = np.abs(row.astype(np.float64))
    w = w / np.maximum(w.sum(axis=1, keepdims=True), 1e-30)
    ranked = -np.sort(-w, axis=1)
    s = (np.cumsum(ranked, axis=1) - ranked)[0]
    for t in s[1:]:  # each running sum as a threshold: `<=` decides on the exact float
        assert row_levels(row, float(t), float(t)) == levels(row, float(t), float(t))[0].tolist()
