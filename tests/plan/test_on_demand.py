"""The on-demand stage and the residency it drives: pins, evictions, streaming when a layer needs more experts
than the cache holds; and a property test over random routing."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.cache.keys import ExpertKey
from moetier.cache.policies import LRUPolicy
from moetier.cache.residency import Residency
from moetier.plan.on_demand import OnDemandStage
from moetier.plan.planner import Planner
from moetier.plan.route import RouteResult

E = 8


def route(layer: int, ids: list[list[int]], step: int = 0) -> RouteResult:
    topk = np.array(ids, dtype=np.int64)
    return RouteResult(layer, step, topk, np.ones(topk.shape, np.float32), np.zeros((len(ids), E), np.float32))


def run_layer(planner: Planner, residency: Residency, layer: int, ids: list[list[int]]):
    plan = planner.plan(route(layer, ids))
    for e in plan.experts:  # what the executor does after computing
        residency.policy.on_access(ExpertKey(layer, e), "bf16", 0)
    residency.unpin_all()
    return plan


def make(slots: int):
    r = Residency(slots, LRUPolicy())
    return r, Planner(E, [OnDemandStage(r)])


def test_hits_and_loads_with_lru():
    r, p = make(4)
    plan = run_layer(p, r, 0, [[0, 1]])
    assert plan.hits == [] and [ld.expert for ld in plan.loads] == [0, 1]
    plan = run_layer(p, r, 1, [[2, 3]])
    assert [ld.expert for ld in plan.loads] == [2, 3] and all(ld.evicted is None for ld in plan.loads)
    plan = run_layer(p, r, 0, [[1, 4]])  # 1 hits; 4 evicts the LRU key (0, 0)
    assert [h.expert for h in plan.hits] == [1]
    assert plan.loads[0].expert == 4 and plan.loads[0].evicted == ExpertKey(0, 0)
    assert plan.loads[0].slot == r.slot_of[ExpertKey(0, 4)]


def test_layer_needing_more_experts_than_slots_streams_through_them():
    """Two slots, one layer needing four experts: later loads reuse slots of experts computed earlier."""
    r, p = make(2)
    plan = run_layer(p, r, 0, [[0, 1], [2, 3]])
    loads = plan.loads
    assert [ld.expert for ld in loads] == [0, 1, 2, 3]
    assert loads[0].after is None and loads[1].after is None
    assert loads[2].after in (0, 1) and loads[3].after in (0, 1) and loads[2].after != loads[3].after
    assert {loads[2].slot, loads[3].slot} == {loads[0].slot, loads[1].slot}
    assert len(r) == 2


def test_hits_are_pinned_while_the_layer_plans():
    r, p = make(2)
    run_layer(p, r, 0, [[0, 1]])
    plan = p.plan(route(1, [[0, 5]]))  # (1,0) and (1,5) both miss; neither may evict the other
    assert {ld.expert for ld in plan.loads} == {0, 5}
    assert ExpertKey(1, 0) in r and ExpertKey(1, 5) in r


@settings(max_examples=60, deadline=None)
@given(slots=st.integers(1, 12), steps=st.lists(
    st.tuples(st.integers(0, 2), st.lists(st.lists(st.integers(0, E - 1), min_size=2, max_size=2, unique=True),
                                          min_size=1, max_size=3)), min_size=1, max_size=30))
def test_residency_invariants_on_random_routing(slots, steps):
    r, p = make(slots)
    for layer, ids in steps:
        before = set(r.slot_of)
        plan = p.plan(route(layer, ids))
        needed = {e for row in ids for e in row}
        assert set(plan.experts) == needed
        assert {h.expert for h in plan.hits} == {e for e in needed if ExpertKey(layer, e) in before}
        assert {h.expert for h in plan.hits} | {ld.expert for ld in plan.loads} == needed
        assert len(r) <= slots
        assert len(set(r.slot_of.values())) == len(r)  # no two keys share a slot
        computed = [h.expert for h in plan.hits]
        for ld in plan.loads:  # a reused slot is taken only from an expert computed before
            assert ld.after is None or ld.after in computed
            computed.append(ld.expert)
        for e in plan.experts:
            r.policy.on_access(ExpertKey(layer, e), "bf16", 0)
        r.unpin_all()
