"""The prefetch stages as pure logic on hand-made routing and predictions: what each rule chooses, how the shared
bookkeeping settles a prefetch (used in time, late, wasted and cancelled), and that prefetch pins never leave the
coming layer without room for its own misses."""

import numpy as np
import pytest

from moetier.cache.keys import ExpertKey
from moetier.cache.policies import LRUPolicy
from moetier.cache.residency import PREFETCHED, Residency
from moetier.plan.costs import RunningCosts
from moetier.plan.device_memory import FixedMemory
from moetier.plan.layer_plan import IN_FLIGHT, RESIDENT
from moetier.plan.on_demand import OnDemandStage
from moetier.plan.planner import Planner
from moetier.plan.prefetch import predicted_ids
from moetier.plan.prefetchers import (
    Comoe37Prefetch,
    ComoePrefetch,
    HobbitPrefetch,
    PreSchedPrefetch,
    SmoePrefetch,
    make_prefetcher,
)
from moetier.plan.route import RouteResult
from moetier.plan.step import LayerStep
from moetier.predict.base import Predictor

E, K = 8, 2
BYTES = {"bf16": 100}


class Scripted(Predictor):
    """Predicts what the test says, per layer."""

    def __init__(self, scores: dict[int, dict[int, list[float]]], distance: int = 1) -> None:
        super().__init__(range(4), E, K, distance)
        self.scores = scores

    def predict(self, layer, gate_input):
        return {f: np.asarray([self.scores[layer][f]], np.float32) for f in self.future_layers(layer)
                if f in self.scores.get(layer, {})}


def one_hot(*experts: int, high: float = 1.0) -> list[float]:
    row = [0.01] * E
    for i, e in enumerate(experts):
        row[e] = high - 0.1 * i
    return row


def route(layer: int, ids: list[int], step: int = 1) -> RouteResult:
    topk = np.array([ids], dtype=np.int64)
    return RouteResult(layer, step, topk, np.ones(topk.shape, np.float32), np.zeros((1, E), np.float32))


def make(slots: int, stage_cls=HobbitPrefetch, scores=None, distance: int = 1, **params):
    r = Residency(slots * 100, BYTES, LRUPolicy())
    stage = stage_cls(r, "bf16", **params)
    step = LayerStep(r, Planner("bf16", [OnDemandStage(r), stage]), predictor=Scripted(scores or {}, distance))
    return r, stage, step


def run(step: LayerStep, layer: int, ids: list[int], land: bool = True):
    """A layer as an executor runs it: plan, reads land (if `land`, prefetches too), end."""
    plan = step.begin(route(layer, ids))
    if land:
        for p in plan.prefetches:
            step.residency.landed(p.key)
    step.end(plan)
    return plan


def test_predicted_ids_are_the_union_of_each_tokens_top_k_by_summed_score():
    scores = np.array([[0.9, 0.5, 0.1, 0.0], [0.0, 0.6, 0.2, 0.7]], np.float32)
    assert predicted_ids(scores, 2) == [1, 0, 3]  # 1.1, 0.9, 0.7


def test_hobbit_prefetches_the_next_layers_predicted_top_k_pinned_until_its_layer_routes():
    r, stage, step = make(6, scores={0: {1: one_hot(3, 5)}})
    plan = run(step, 0, [0, 1])
    assert [p.key for p in plan.prefetches] == [ExpertKey(1, 3), ExpertKey(1, 5)]
    assert r.pinned(PREFETCHED) == {ExpertKey(1, 3), ExpertKey(1, 5)}
    plan = run(step, 1, [3, 4])  # 3 used in time, 5 proven wrong
    assert (plan.prefetch_used, plan.prefetch_late, plan.prefetch_wasted) == (1, 0, 1)
    assert [run.expert for run in plan.hits] == [3]
    assert r.pinned(PREFETCHED) == set() and ExpertKey(1, 5) in r  # unpinned, still cached, evictable


def test_a_prefetch_still_reading_is_late_if_needed_and_cancelled_if_not():
    r, stage, step = make(6, scores={0: {1: one_hot(3, 5)}})
    run(step, 0, [0, 1], land=False)
    plan = step.begin(route(1, [3, 4]))
    sources = {run.expert: run.source for run in plan.runs}
    assert sources[3] == IN_FLIGHT and plan.prefetch_late == 1 and plan.prefetch_used == 0
    assert plan.cancels == [ExpertKey(1, 5)] and plan.prefetch_wasted == 1


def test_hobbit_looks_further_while_every_predicted_expert_is_cached():
    r, stage, step = make(8, scores={1: {2: one_hot(0, 1), 3: one_hot(6, 7)}}, distance=2)
    run(step, 2, [0, 1])  # layer 2's predicted experts are now resident
    plan = run(step, 1, [2, 3])
    assert [p.key for p in plan.prefetches] == [ExpertKey(3, 6), ExpertKey(3, 7)]
    assert {ExpertKey(2, 0), ExpertKey(2, 1)} <= r.pinned(PREFETCHED)  # masked from eviction, not read


def test_hobbit_stops_at_the_first_layer_with_a_missing_expert():
    r, stage, step = make(8, scores={1: {2: one_hot(0, 1), 3: one_hot(6, 7)}}, distance=2)
    plan = run(step, 1, [2, 3])
    assert [p.key.layer for p in plan.prefetches] == [2, 2]


def test_prefetch_pins_leave_room_for_the_coming_layers_own_misses():
    """Three slots, top-2: at most one may be pinned by prefetches, whatever is predicted."""
    r, stage, step = make(3, scores={0: {1: one_hot(3, 5)}})
    plan = run(step, 0, [0, 1])
    assert len(plan.prefetches) == 1 and len(r.pinned(PREFETCHED)) == 1
    plan = run(step, 1, [6, 7])  # two misses, both find room
    assert len(plan.loads) == 2


def test_a_prefetch_never_evicts_what_the_coming_layers_used_last_time():
    """Five slots, all full: layer 2's experts are the least recent (LRU's victims), but layer 2 has not run yet
    in this step and used them last time, so a prefetch for layer 3 takes a victim of a layer that has run — or,
    with none, does not go out. Experts a coming layer did not use last time are fair victims."""
    r, stage, step = make(5, scores={1: {3: one_hot(6)}}, distance=2)
    run(step, 2, [0, 1])  # oldest
    run(step, 0, [2, 3])
    plan = run(step, 1, [4])  # full now: 2/0, 2/1, 0/2, 0/3, 1/4; prefetch 3/6
    assert [p.key for p in plan.prefetches] == [ExpertKey(3, 6)]
    assert plan.prefetches[0].evicted == (ExpertKey(0, 2),)  # not layer 2's, though they are older
    assert {ExpertKey(2, 0), ExpertKey(2, 1)} <= set(r.entries)

    r, _, step = make(3, scores={1: {3: one_hot(6)}}, distance=2)
    run(step, 2, [0, 1])
    plan = run(step, 1, [4])  # the only evictable experts are layer 2's working set
    assert plan.prefetches == [] and {ExpertKey(2, 0), ExpertKey(2, 1)} <= set(r.entries)

    r, _, step = make(4, scores={1: {3: one_hot(6)}}, distance=2)
    run(step, 2, [0, 1])
    run(step, 2, [5, 1])  # layer 2 last used 5 and 1: 2/0 is stale
    plan = run(step, 1, [4])
    assert [p.evicted for p in plan.prefetches] == [(ExpertKey(2, 0),)]


def test_smoe_prefetches_only_top_score_experts():
    # scores: expert 2 towers over the (k+1)-th score (0.2); expert 4 (0.22) is inside (1+α)·S_{k+1} = 0.26
    row = [0.01, 0.2, 0.9, 0.01, 0.22, 0.01, 0.01, 0.01]
    r, stage, step = make(6, SmoePrefetch, scores={0: {1: row}}, alpha=0.3)
    plan = run(step, 0, [0, 1])
    assert [p.key for p in plan.prefetches] == [ExpertKey(1, 2)]


def test_comoe_threshold_is_equation_19():
    costs = RunningCosts(100)
    for bandwidth in (100.0, 300.0, 100.0, 300.0):  # a swinging link
        costs.observe_read(int(bandwidth), 1.0)
    r, stage, step = make(4, ComoePrefetch, costs=costs, theta_base=0.2, delta=0.5, memory=FixedMemory((0.6,)))
    samples = np.array([100.0, 300.0, 100.0, 300.0])
    s_b = 1 - np.sqrt(np.mean((samples - costs.bandwidth) ** 2)) / costs.bandwidth  # Eq. 11-12 around r̂ (Eq. 10)
    assert 0 < s_b < 1 and stage.threshold() == pytest.approx(0.2 * s_b * (1 + 0.5 * 0.6))  # the device's 60% free
    row = [0.5, 0.3, 0.1, 0.1, 0, 0, 0, 0]  # a distribution: 0.5 and 0.3 pass a threshold near 0.15
    step.predictor.scores = {0: {1: row}}
    plan = run(step, 0, [6, 7])
    assert stage.threshold() < 0.3 and [p.key for p in plan.prefetches] == [ExpertKey(1, 0), ExpertKey(1, 1)]


def test_comoe_37_threshold_is_gamma_times_the_devices_free_share():
    """Eq. 37's M_avail/M_GPU is the device's free memory: on a made series, a cache full by design on a machine
    with room keeps θ_pre > 0 (the cache's own free share made it 0 and prefetched every predicted expert)."""
    memory = FixedMemory((0.5, 0.5, 0.25, 0.0))
    r, stage, step = make(2, Comoe37Prefetch, costs=RunningCosts(100), theta_base=0.4, memory=memory)
    run(step, 0, [6, 7])  # both slots taken: the cache is full
    assert r.free_bytes == 0
    assert [stage.threshold() for _ in range(4)] == pytest.approx([0.2, 0.2, 0.1, 0.0])
    assert stage.threshold() == 0.0  # the series' last reading holds


def test_the_device_gauges_read_free_over_total_at_most_every_refresh():
    from moetier.plan.device_memory import HostMemory, _Sampled

    readings = iter([(30, 100), (80, 100)])
    gauge = _Sampled(lambda: next(readings), refresh_s=3600)
    assert gauge.free_share() == 0.3 and gauge.free_share() == 0.3  # (not read again within the hour)
    assert 0 < HostMemory().free_share() <= 1
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        FixedMemory((1.5,))


def test_presched_counts_prefetches_per_equations_6_and_7():
    costs = RunningCosts(100)
    costs.observe_read(100, 1.0)  # t_io = 1
    costs.observe_dense(0.8)  # t_attn
    costs.observe_expert(0.5)  # t_e
    r, stage, step = make(10, PreSchedPrefetch, costs=costs)
    for e in (0, 1):  # layer 0's experts resident: the layer reads nothing
        r.admit(ExpertKey(0, e), "bf16")
        r.landed(ExpertKey(0, e))
    r.unpin_all()
    plan = step.begin(route(0, [0, 1]))
    # T_gap = 2 resident · 0.5 − 0 − 0 reads = 1.0; f = (1.0 + 0.8) / 1 = 1.8 → |f| = 2; with the prior hit rate
    # 0.5, ξ = 0.5·(1.8 − 2 + 1) − 0.5·(2 − 1.8) = 0.3 > 0: keep both
    assert stage.count(plan) == 2
    stage.rank_hit = [0.5, 0.1]  # the second prefetch is rarely used: ξ = 0.1·0.8 − 0.9·0.2 < 0 → drop it
    assert stage.count(plan) == 1


def test_presched_learns_each_ranks_hit_rate():
    costs = RunningCosts(100)
    costs.observe_read(100, 0.1)
    costs.observe_dense(1.0)
    costs.observe_expert(0.1)
    r, stage, step = make(10, PreSchedPrefetch, scores={0: {1: one_hot(3, 5)}}, costs=costs, smoothing=0.5)
    plan = run(step, 0, [0, 1])
    assert [p.key for p in plan.prefetches] == [ExpertKey(1, 3), ExpertKey(1, 5)]
    run(step, 1, [3, 4])  # rank 0 used, rank 1 not
    assert stage.rank_hit == [pytest.approx(0.75), pytest.approx(0.25)]


def presched_costs(host_s: float | None = None) -> RunningCosts:
    costs = RunningCosts(100)
    costs.observe_read(100, 1.0)  # t_io = 1
    costs.observe_dense(0.05)  # t_attn
    costs.observe_expert(0.1)  # t_g
    if host_s is not None:
        costs.observe_host(1, host_s)  # t_c flat
    return costs


def test_presched_extends_its_window_when_the_gpu_queue_holds_none_of_the_next_layers_experts():
    """Alg. 1's PrefetchDecision at batch 1 with a CPU lane (Q4): the CPU computes layer 0's two misses (t_c 0.2
    each); Eq. 4 on them and layer 1's two predicted: T_C(3) = 0.8 + 0.05 < T_G(3) = 1 + 0.1, the GPU queue holds
    none of layer 1's, so nothing is read for it. The window grows to layer 2: T_C(5) = 1.2 + 0.1 > 1.1 queues
    layer 2's best; f = 2 · (0.4 + 0.05) / 1 = 0.9, |f| = 1, ξ = 0.5·0.9·t_g − 0.5·0.1·t_g > 0: one prefetch."""
    from moetier.plan.placement import PreSchedPlacement

    costs = presched_costs(host_s=0.2)
    r = Residency(10 * 100, BYTES, LRUPolicy())
    stage = PreSchedPrefetch(r, "bf16", costs=costs, cpu_lane=True)
    predictor = Scripted({0: {1: one_hot(3, 5), 2: one_hot(4, 6)}}, distance=2)
    step = LayerStep(r, Planner("bf16", [PreSchedPlacement(r, costs), OnDemandStage(r), stage]), predictor=predictor)
    plan = step.begin(route(0, [0, 1]))
    assert sorted(e for e, place in plan.place.items() if place == "host") == [0, 1]
    assert [p.key for p in plan.prefetches] == [ExpertKey(2, 4)]
    # the same layer alone (distance 1): the queue never reaches a predicted expert, so nothing is read
    r1 = Residency(10 * 100, BYTES, LRUPolicy())
    near = PreSchedPrefetch(r1, "bf16", costs=costs, cpu_lane=True)
    step1 = LayerStep(r1, Planner("bf16", [PreSchedPlacement(r1, costs), OnDemandStage(r1), near]),
                      predictor=Scripted({0: {1: one_hot(3, 5)}}, distance=1))
    assert step1.begin(route(0, [0, 1])).prefetches == []
    # a slower CPU (t_c 0.3): Eq. 4 queues layer 1's best, T_C(3) = 1.2 + 0.05 > 1.1, and f = 0.65 → |f| = 1 for it
    r2 = Residency(10 * 100, BYTES, LRUPolicy())
    slow = presched_costs(host_s=0.3)
    stage2 = PreSchedPrefetch(r2, "bf16", costs=slow, cpu_lane=True)
    step2 = LayerStep(r2, Planner("bf16", [PreSchedPlacement(r2, slow), OnDemandStage(r2), stage2]),
                      predictor=Scripted({0: {1: one_hot(3, 5), 2: one_hot(4, 6)}}, distance=2))
    assert [p.key for p in step2.begin(route(0, [0, 1])).prefetches] == [ExpertKey(1, 3)]


def test_presched_without_a_cpu_lane_looks_past_a_next_layer_it_already_holds():
    costs = RunningCosts(100)
    costs.observe_read(100, 1.0)
    costs.observe_dense(0.8)
    costs.observe_expert(0.5)
    r, stage, step = make(10, PreSchedPrefetch, scores={0: {1: one_hot(3, 5), 2: one_hot(4, 6)}}, distance=2,
                          costs=costs)
    for key in (ExpertKey(0, 0), ExpertKey(0, 1), ExpertKey(1, 3), ExpertKey(1, 5)):  # layer 1's prediction cached
        r.admit(key, "bf16")
        r.landed(key)
    r.unpin_all()
    plan = step.begin(route(0, [0, 1]))
    # f = 2 · (2 · 0.5 + 0.8) / 1 = 3.6 for the window of two layers: both of layer 2's predicted experts
    assert [p.key for p in plan.prefetches] == [ExpertKey(2, 4), ExpertKey(2, 6)]
    assert {ExpertKey(1, 3), ExpertKey(1, 5)} <= r.pinned(PREFETCHED)  # layer 1's masked from eviction, not read


def test_make_prefetcher_refuses_unknown_names_and_a_stage_without_a_predictor():
    from moetier.errors import MoetierError
    from moetier.plan.prefetchers import layer_stages

    r = Residency(400, BYTES, LRUPolicy())
    with pytest.raises(MoetierError, match="unknown prefetcher 'nope'"):
        make_prefetcher("nope", r, "bf16", RunningCosts(100), K)
    with pytest.raises(MoetierError, match="prefetch 'hobbit' needs a predictor"):
        layer_stages(r, "bf16", "hobbit", None, RunningCosts(100), K)
    assert [type(s).__name__ for s in layer_stages(r, "bf16", "none", None, RunningCosts(100), K)] == ["OnDemandStage"]


def test_wasted_prefetches_of_resident_experts_are_not_counted_as_reads():
    r, stage, step = make(6, scores={0: {1: one_hot(3, 5)}})
    run(step, 1, [3, 5])  # both resident already
    plan = run(step, 0, [0, 1])
    assert plan.prefetches == [] and r.pinned(PREFETCHED) == {ExpertKey(1, 3), ExpertKey(1, 5)}
    plan = run(step, 1, [6, 7])
    assert plan.prefetch_wasted == 0 and r.pinned(PREFETCHED) == set()
    assert all(run.source != RESIDENT for run in plan.runs)


def test_smoe_prefetch_takes_the_substitutions_alpha_as_it_is_tuned():
    """SMoE §IV-C prefetches by the same α its substitution uses; a TPOT budget retunes that α while running."""
    from moetier.cache.policies import make_policy
    from moetier.cache.policies.context import PolicyContext
    from moetier.plan.costs import RunningCosts
    from moetier.plan.pipeline import plan_stages
    from moetier.plan.precision import MixedPrecision, setup
    from moetier.plan.substitute import Substitution, SubstitutionStage

    def stages(substitution):
        ctx = PolicyContext(4, (0, 1), 8, 2)
        made = setup(MixedPrecision(), "bf16", {"bf16": 1}, 4, make_policy("lru", ctx), (0, 1), 8, 2, False)
        return plan_stages(made, substitution, "smoe", object(), RunningCosts(1), 2)

    made = stages(Substitution(alpha=0.5))
    sub = next(s for s in made if isinstance(s, SubstitutionStage))
    prefetch = next(s for s in made if isinstance(s, SmoePrefetch))
    assert prefetch.alpha == 0.5
    sub.alpha = 0.15
    assert prefetch.alpha == 0.15
    alone = next(s for s in stages(None) if isinstance(s, SmoePrefetch))
    assert alone.alpha == 0.3  # no substitution: SMoE's mid-size setting
