"""CoMoE's offload priority (Eq. 18) as the order a shrinking cache empties in: the least used leave first, a copy
that reads at a better rate stays before an equally used one that does not, and a simulated run under memory
pressure keeps the experts used most where LRU keeps the most recent."""

import numpy as np
import pytest

from moetier.cache.keys import ExpertKey
from moetier.cache.policies import LRUPolicy
from moetier.plan.offload_priority import OffloadPriority
from moetier.plan.route import DECODE, RouteResult
from moetier.sim.cost import FreeCost
from moetier.sim.replay import simulate
from moetier.trace.format import Trace


def route(layer, ids):
    ids = np.array(ids, np.int64)
    return RouteResult(layer, 0, ids, np.ones(ids.shape, np.float32), np.zeros((len(ids), 4), np.float32), DECODE)


def test_the_least_used_leave_first_and_a_better_read_rate_stays():
    sizes = {ExpertKey(0, e): 100 for e in range(4)} | {ExpertKey(0, 3): 25}  # expert 3 a low-precision copy
    order = OffloadPriority([0], 4, sizes.__getitem__, lambda: 1e3, gamma=0.5)
    order.on_route(route(0, [[0, 1], [0, 2], [0, 3]]), None)  # 0 three times; 1, 2, 3 once
    assert not order.needs_plans  # (a step of resident layers tells it its routes)
    assert order.frequency(ExpertKey(0, 0)) == pytest.approx(3 / 6) and order.frequency(ExpertKey(0, 1)) == 1 / 6
    keys = list(sizes)
    p = order.priorities(keys)
    # equally used 1, 2, 3: the small copy reads at a worse rate (a read's latency weighs more), so it leaves first
    assert order.victim_among(keys) == ExpertKey(0, 3) and p[ExpertKey(0, 0)] == max(p.values())
    assert order.victim_among([ExpertKey(0, 0), ExpertKey(0, 2)]) == ExpertKey(0, 2)
    rate_only = OffloadPriority([0], 4, sizes.__getitem__, lambda: 1e3, gamma=0.0)
    assert rate_only.victim_among([ExpertKey(0, 0), ExpertKey(0, 3)]) == ExpertKey(0, 3)
    with pytest.raises(ValueError):
        OffloadPriority([0], 4, sizes.__getitem__, lambda: None, gamma=1.5)


def one_layer(refs: list[int], num_experts: int = 6) -> Trace:
    ids = np.array(refs, np.int16).reshape(-1, 1, 1)  # [T, 1, k=1]
    n = len(refs)
    return Trace("m", 1, num_experts, 1, [0], np.zeros(n, np.int32), np.arange(n, dtype=np.int32),
                 np.ones(n, np.uint8), ids, np.ones(ids.shape, np.float16))


def test_under_pressure_eq_18_keeps_the_most_used_where_lru_keeps_the_most_recent():
    # expert 0 used often early, then 1..4 once each; the cache of 5 shrinks to 2 before the last step
    refs = [0, 0, 0, 0, 1, 2, 3, 4, 0]
    trace = one_layer(refs)
    kept = {}
    for shrink in ("offload-priority", "policy"):
        res = simulate(trace, LRUPolicy(), 5, FreeCost(), resizes={8: 2}, shrink=shrink, keep_plans=True)
        kept[shrink] = [r.expert for r in res.plans[-1].hits]
    assert kept == {"offload-priority": [0], "policy": []}  # LRU let 0 go (least recent); Eq. 18 kept it
    with pytest.raises(ValueError, match="unknown shrink order"):
        simulate(trace, LRUPolicy(), 5, FreeCost(), resizes={8: 2}, shrink="fifo")


def test_a_predictor_must_cover_the_traces_layers():
    from moetier.predict.hot import HotPredictor

    trace = one_layer([0, 1, 0])
    other = HotPredictor([5], 6, 1, {5: np.ones(6)})
    with pytest.raises(ValueError, match="must cover the trace's MoE layers"):
        simulate(trace, LRUPolicy(), 2, FreeCost(), predictor=other)
