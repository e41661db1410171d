"""The on-demand stage and the residency it drives: pins, evictions, streaming when a layer needs more experts
than the cache holds; and a property test over random routing."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.cache.keys import ExpertKey
from moetier.cache.policies import LRUPolicy
from moetier.cache.residency import Residency
from moetier.plan.layer_plan import LOAD, RESIDENT
from moetier.plan.on_demand import OnDemandStage
from moetier.plan.planner import Planner
from moetier.plan.route import RouteResult
from moetier.plan.step import LayerStep

E = 8
BF16 = {"bf16": 100}  # bytes of one expert


def route(layer: int, ids: list[list[int]], step: int = 0) -> RouteResult:
    topk = np.array(ids, dtype=np.int64)
    return RouteResult(layer, step, topk, np.ones(topk.shape, np.float32), np.zeros((len(ids), E), np.float32))


def make(slots: int):
    r = Residency(slots * 100, BF16, LRUPolicy())
    return r, LayerStep(r, Planner("bf16", [OnDemandStage(r)]))


def run_layer(step: LayerStep, layer: int, ids: list[list[int]]):
    plan = step.begin(route(layer, ids))
    step.end(plan)  # what the executor does once it computed the plan
    return plan


def test_hits_and_loads_with_lru():
    r, s = make(4)
    plan = run_layer(s, 0, [[0, 1]])
    assert plan.hits == [] and [ld.expert for ld in plan.loads] == [0, 1]
    plan = run_layer(s, 1, [[2, 3]])
    assert [ld.expert for ld in plan.loads] == [2, 3] and all(ld.evicted == () for ld in plan.loads)
    plan = run_layer(s, 0, [[1, 4]])  # 1 hits; 4 evicts the LRU key (0, 0)
    assert [h.expert for h in plan.hits] == [1]
    assert plan.loads[0].expert == 4 and plan.loads[0].evicted == (ExpertKey(0, 0),)
    assert plan.loads[0].slot == r.entries[ExpertKey(0, 4)].slot
    assert [(run.expert, run.source) for run in plan.runs] == [(1, RESIDENT), (4, LOAD)]  # resident first


def test_layer_needing_more_experts_than_slots_streams_through_them():
    """Two slots, one layer needing four experts: later loads reuse slots of experts computed earlier."""
    r, s = make(2)
    loads = run_layer(s, 0, [[0, 1], [2, 3]]).loads
    assert [ld.expert for ld in loads] == [0, 1, 2, 3]
    assert loads[0].after is None and loads[1].after is None
    assert loads[2].after in (0, 1) and loads[3].after in (0, 1) and loads[2].after != loads[3].after
    assert {loads[2].slot, loads[3].slot} == {loads[0].slot, loads[1].slot}
    assert len(r) == 2 and r.used_bytes == 200


def test_hits_are_pinned_while_the_layer_plans():
    r, s = make(2)
    run_layer(s, 0, [[0, 1]])
    plan = s.begin(route(1, [[0, 5]]))  # (1,0) and (1,5) both miss; neither may evict the other
    assert {ld.expert for ld in plan.loads} == {0, 5}
    assert r.loading(ExpertKey(1, 0)) and r.loading(ExpertKey(1, 5))  # read, not yet resident
    s.end(plan)
    assert ExpertKey(1, 0) in r and ExpertKey(1, 5) in r


def test_a_read_in_flight_is_neither_resident_nor_free_and_is_waited_for():
    r, s = make(3)
    key = ExpertKey(1, 2)
    slot, evicted = r.admit(key, "bf16", pin="prefetched")  # a prefetch an earlier layer started
    assert key not in r and r.loading(key) and r.free_bytes == 200 and evicted == ()
    plan = s.begin(route(1, [[2, 3]]))
    assert [(run.expert, run.source, run.slot) for run in plan.runs] == [(2, "in-flight", slot), (3, "load", 1)]
    s.end(plan)  # computed: its read had landed
    assert key in r and not r.pinned("prefetched") and not r.pinned("in-use")


def test_prefetched_and_loading_entries_are_never_evicted():
    r, _ = make(2)
    r.admit(ExpertKey(0, 0), "bf16", pin="prefetched")
    r.admit(ExpertKey(0, 1), "bf16")
    r.landed(ExpertKey(0, 1))
    r.unpin_all()  # drops in-use pins only
    assert r.pinned("prefetched") == {ExpertKey(0, 0)}
    assert r.admit(ExpertKey(0, 2), "bf16")[1] == (ExpertKey(0, 1),)  # the only evictable one
    r.unpin_all()
    assert r.admit(ExpertKey(0, 3), "bf16") is None  # (0,0) prefetched, (0,2) still loading


def test_capacity_grows_and_shrinks_between_steps():
    r, s = make(2)
    run_layer(s, 0, [[0, 1]])
    r.resize(400)
    run_layer(s, 1, [[0, 1]])
    assert len(r) == 4 and r.free_bytes == 0
    assert r.resize(200) == [ExpertKey(0, 0), ExpertKey(0, 1)]  # by policy: the least recently used go
    assert len(r) == 2 and r.used_bytes == 200
    r.admit(ExpertKey(2, 0), "bf16")  # pinned and loading
    r.admit(ExpertKey(2, 1), "bf16")
    try:
        r.resize(100)
        raise AssertionError("a cache whose entries are all held cannot shrink")
    except ValueError as e:
        assert "pinned, kept or being read" in str(e)
    assert r.capacity_bytes == 200


@settings(max_examples=60, deadline=None)
@given(slots=st.integers(1, 12), steps=st.lists(
    st.tuples(st.integers(0, 2), st.lists(st.lists(st.integers(0, E - 1), min_size=2, max_size=2, unique=True),
                                          min_size=1, max_size=3)), min_size=1, max_size=30))
def test_residency_invariants_on_random_routing(slots, steps):
    r, s = make(slots)
    for layer, ids in steps:
        before = {k for k in r.entries if k in r}
        plan = s.begin(route(layer, ids))
        needed = {e for row in ids for e in row}
        assert set(plan.experts) == needed
        assert {h.expert for h in plan.hits} == {e for e in needed if ExpertKey(layer, e) in before}
        assert [run.expert for run in plan.runs if run.source == LOAD] == [ld.expert for ld in plan.loads]
        assert {run.expert for run in plan.runs} == needed
        assert r.used_bytes == 100 * len(r) <= 100 * slots
        assert len({e.slot for e in r.entries.values()}) == len(r)  # no two keys share a slot
        computed = [h.expert for h in plan.hits]
        for ld in plan.loads:  # a reused slot is taken only from an expert computed before
            assert ld.after is None or ld.after in computed
            computed.append(ld.expert)
        s.end(plan)
        assert not r.pinned() and all(k in r for k in r.entries)
