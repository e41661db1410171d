"""LayerPlan.one_token_order: which plans the executor may compute in the kernel's one-token call — one token, each
of its experts one pair, all resident at one precision, the runs in ascending ids — on hand-made plans."""

import numpy as np

from moetier.plan.layer_plan import IN_FLIGHT, LOAD, RESIDENT, SKIP, LayerPlan, Run
from moetier.plan.route import RouteResult


def plan(ids, runs, weights=None) -> LayerPlan:
    ids = np.array(ids, dtype=np.int64)
    weights = np.full(ids.shape, 0.25, dtype=np.float32) if weights is None else np.array(weights, np.float32)
    route = RouteResult(3, 1, ids, weights, np.zeros((ids.shape[0], 8), np.float32))
    p = LayerPlan(route, ids, weights, {}, {})
    p.runs = [Run(e, precision, slot, source) for e, precision, slot, source in runs]
    return p


def resident(*experts, precision="bf16"):
    return [(e, precision, 10 + e, RESIDENT) for e in experts]


def test_one_tokens_resident_experts_come_in_the_order_of_their_ids():
    p = plan([[5, 1, 3]], resident(1, 3, 5), weights=[[0.5, 0.3, 0.2]])
    order = p.one_token_order()
    assert order.tolist() == [1, 2, 0]
    assert p.assign_ids[0][order].tolist() == [1, 3, 5]
    assert p.assign_weights[0][order].tolist() == np.array([0.3, 0.2, 0.5], np.float32).tolist()


def test_plans_the_one_token_call_would_get_wrong_are_grouped():
    assert plan([[5, 1], [2, 1]], resident(1, 2, 5)).one_token_order() is None  # two tokens
    assert plan([[5, SKIP]], resident(5)).one_token_order() is None  # a skipped pair
    assert plan([[5, 5]], resident(5)).one_token_order() is None  # a substitute run twice
    loading = plan([[5, 1]], [(1, "bf16", 11, RESIDENT), (5, "bf16", 15, LOAD)])
    assert loading.one_token_order() is None  # a miss
    assert plan([[5, 1]], [(1, "bf16", 11, RESIDENT), (5, "bf16", 15, IN_FLIGHT)]).one_token_order() is None
    assert plan([[5, 1]], resident(1) + resident(5, precision="int4")).one_token_order() is None  # two precisions
    assert plan([[5, 1]], resident(5, 1)).one_token_order() is None  # runs not in ascending ids (a low tier's first)
