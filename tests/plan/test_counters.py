"""The counting hook scores the predictor as the layers run: each layer's prediction of the next MoE layer
against that layer's routing in the same step (hand-made plans)."""

import numpy as np

from moetier.plan.counters import CountingHook, predictor_recall
from moetier.plan.layer_plan import LayerPlan
from moetier.plan.route import DECODE, PREFILL, RouteResult

E = 6


def plan(layer: int, ids: list[list[int]], predictions: dict[int, list[list[float]]] | None = None) -> LayerPlan:
    topk = np.asarray(ids, dtype=np.int64)  # [T, k]
    route = RouteResult(layer, 1, topk, np.ones(topk.shape, np.float32), np.zeros((len(ids), E), np.float32))
    p = LayerPlan.exact(route, "bf16")
    p.predictions = {f: np.asarray(s, np.float32) for f, s in (predictions or {}).items()}
    return p


def test_recall_counts_the_next_layers_true_pairs_among_the_predicted_top_k():
    hook = CountingHook({"bf16": 1})
    scores = [[0, 9, 8, 0, 0, 0], [7, 0, 0, 0, 0, 6]]  # token 0: {1, 2}; token 1: {0, 5}
    far = [[0, 0, 0, 0, 9, 9]] * 2  # a prediction two layers ahead is not scored
    hook.on_plan(plan(0, [[0, 1], [2, 3]], {1: scores, 2: far}), DECODE)
    hook.on_plan(plan(1, [[1, 3], [5, 0]], {2: far}), DECODE)  # 1 of token 0, both of token 1
    hook.on_plan(plan(2, [[0, 1], [2, 3]]), DECODE)  # {4, 5} predicted: none right
    c = hook.phases[DECODE]
    assert (c.predicted, c.predicted_right) == (8, 3)
    assert predictor_recall(c) == 3 / 8 and predictor_recall(hook.phases[PREFILL]) is None


def test_a_layer_without_a_prediction_is_not_scored():
    hook = CountingHook({"bf16": 1})
    hook.on_plan(plan(0, [[0, 1]]), DECODE)
    hook.on_plan(plan(1, [[0, 1]]), DECODE)
    assert hook.phases[DECODE].predicted == 0


def test_a_layer_of_hits_counted_without_its_plan_is_what_the_plan_counts():
    from moetier.plan.counters import PhaseCounters
    from moetier.plan.layer_plan import RESIDENT, Run

    p = plan(0, [[0, 1], [2, 1]])  # three distinct experts, all resident
    p.runs = [Run(e, "bf16", e, RESIDENT) for e in (0, 1, 2)]
    planned, direct = PhaseCounters(), PhaseCounters()
    planned.add(p, {"bf16": 10}, "bf16")
    direct.add_hits(3)
    assert direct == planned and (direct.layer_steps, direct.needed, direct.hits) == (1, 3, 3)
