"""Every ArrayScoredPolicy's victim, sorted from its arrays, is the victim ScoredPolicy's scan of every resident
names: lowest priority, then least recently used, then key order — on random event sequences (the arrays equal to
`priority`, float for float), and over a whole replay."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.arrayed import ArrayScoredPolicy
from moetier.cache.policies.belady import BeladyPolicy
from moetier.cache.policies.comoe import CoMoEPolicy
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.flashmoe_ml import CacheModel, FlashMoEMLPolicy, LayerMLP, features
from moetier.cache.policies.fld import FLDPolicy
from moetier.cache.policies.hobbit import HobbitPolicy, HobbitWeights
from moetier.cache.policies.lhu import LHUPolicy
from moetier.cache.policies.scored import ScoredPolicy
from moetier.cache.policies.smoe_score import SMoEScorePolicy
from moetier.cache.policies.static_hot import StaticHotPolicy
from moetier.plan.route import DECODE, PREFILL, RouteResult
from moetier.sim.replay import replay
from moetier.trace.format import Trace

LAYERS = (3, 1, 5)  # execution order unlike key order, so the last tie-break is tried
E = 6
CTX = PolicyContext(8, LAYERS, E, 2, high_precision="bf16")



def networks(layers, widths=(2, 8, 8, 1), seed=0) -> CacheModel:
    """A random network a layer (Table 1's form, narrower)."""
    rng = np.random.default_rng(seed)
    return CacheModel({layer: LayerMLP(tuple(rng.normal(size=(a, b)) for a, b in zip(widths, widths[1:])),
                                       tuple(rng.normal(size=b) for b in widths[1:])) for layer in layers}, "random")


def random_future(ctx: PolicyContext, horizon: int = 200, seed: int = 0) -> dict[ExpertKey, list[int]]:
    """Each expert's use times, ascending (some never used)."""
    rng = np.random.default_rng(seed)
    return {ExpertKey(layer, e): sorted(set(rng.integers(0, horizon, rng.integers(0, 30)).tolist()))
            for layer in ctx.layers for e in range(ctx.num_experts)}


POLICIES = {
    "belady": lambda ctx: BeladyPolicy(ctx, random_future(ctx)),
    "comoe": CoMoEPolicy,
    "flashmoe-ml": lambda ctx: FlashMoEMLPolicy(ctx, networks(ctx.layers)),
    "fld": FLDPolicy,
    "lhu": LHUPolicy,
    "smoe-score": lambda ctx: SMoEScorePolicy(ctx, window=3),
    "hobbit": lambda ctx: HobbitPolicy(ctx, HobbitWeights(0.4, 0.1, 0.3, 0.2)),
    "static-hot": lambda ctx: StaticHotPolicy(ctx, {ExpertKey(layer, e): (3 * e + layer) % 5 for layer in ctx.layers
                                                    for e in range(ctx.num_experts)}),  # ties among the counts
}


def route(layer: int, step: int, ids: list[int], weights: list[float], draw: int, phase: int = DECODE) -> RouteResult:
    topk_ids = np.asarray(ids, np.int64).reshape(1, -1)  # [T, k]
    topk_weights = np.asarray(weights, np.float32).reshape(1, -1)
    scores = np.random.default_rng(draw).random((1, E)).astype(np.float32)  # [T, E]
    return RouteResult(layer, step, topk_ids, topk_weights, scores, phase)


events = st.lists(st.tuples(st.sampled_from(["route", "prefill", "insert", "evict", "access", "access-low", "admit",
                                             "predict", "sequence", "victim"]),
                            st.sampled_from(LAYERS), st.integers(0, E - 1), st.integers(0, E - 1),
                            st.floats(0.05, 1.0), st.integers(0, 2**16)), min_size=1, max_size=120)


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=100, deadline=None)
@given(events)
@example([("insert", 3, 4, 0, 0.5, 0), ("insert", 3, 1, 0, 0.5, 0), ("access", 3, 4, 0, 0.5, 0),
          ("access", 3, 1, 0, 0.5, 0), ("victim", 3, 0, 0, 0.5, 5)])  # a tie in priority: the least recent leaves
@example([("access", 1, 2, 0, 0.5, 0), ("route", 1, 0, 1, 0.5, 0), ("insert", 1, 0, 0, 0.5, 0),
          ("victim", 1, 0, 0, 0.5, 0)] + [("insert", 1, e, 0, 0.5, 0) for e in range(1, E)]
         + [("victim", 1, 0, 0, 0.5, d) for d in range(4)])  # residents inserted after a victim, within a step
def test_the_arrays_name_the_scans_victim(name, seq):
    p = POLICIES[name](CTX)
    assert isinstance(p, ArrayScoredPolicy)
    for step, (kind, layer, a, b, w, draw) in enumerate(seq):
        key = ExpertKey(layer, a)
        if kind in ("route", "prefill"):
            ids = sorted({a, b})
            p.on_route(route(layer, step, ids, [w, 1 - w][:len(ids)], draw, PREFILL if kind == "prefill" else DECODE))
        elif kind == "insert" and key not in p.resident:
            p.on_insert(key)
        elif kind == "evict" and key in p.resident:
            p.on_evict(key)
        elif kind in ("access", "access-low"):
            p.on_access(key, "bf16" if kind == "access" else "int4", step)
        elif kind == "admit":
            p.on_admit(key)
        elif kind == "predict":
            scores = np.random.default_rng(draw).random((2, E)).astype(np.float32)  # [T, E]
            p.on_predict({layer: scores})
        elif kind == "sequence":
            p.on_sequence_start()
        elif kind == "victim" and p.resident:
            rng = np.random.default_rng(draw)
            candidates = {k for k in p.resident if rng.random() < 0.7} or set(p.resident)
            assert p.victim(candidates) == ScoredPolicy.victim(p, candidates) == p.victim_among(list(candidates))
            if name == "flashmoe-ml":  # its arrays hold only the residents' distances: held to the networks' own
                scanned, predicted = each_victim_scan(p, candidates)
                victim = p.victim(candidates)
                assert victim == scanned or predicted[victim] == pytest.approx(predicted[scanned], rel=1e-5, abs=1e-6)
        priorities = p.priorities()
        for layer_ in LAYERS:  # the arrays are `priority`'s, float for float
            assert list(priorities[p.row[layer_]]) == [p.priority(ExpertKey(layer_, e)) for e in range(E)]


@pytest.mark.parametrize("name", POLICIES)
def test_a_replay_makes_the_same_choices_either_way(name):
    rng = np.random.default_rng(0)
    n, layers, experts, k = 300, 4, 16, 2
    skew = rng.dirichlet(np.full(experts, 0.3), size=layers)  # [L, E] each layer's favourites
    ids = np.stack([[rng.choice(experts, k, replace=False, p=skew[j]) for j in range(layers)] for _ in range(n)])
    trace = Trace("hand-made", layers, experts, k, list(range(layers)), np.repeat(np.arange(3), 100).astype(np.int32),
                  np.tile(np.arange(100), 3).astype(np.int32), np.full(n, DECODE, np.uint8), ids.astype(np.int16),
                  np.full(ids.shape, 0.5, np.float16))
    ctx = PolicyContext(12, tuple(range(layers)), experts, k)
    make = POLICIES[name]
    fast = replay(trace, make(ctx), 12)
    scan = make(ctx)
    scan.victim = lambda candidates: ScoredPolicy.victim(scan, candidates)
    slow = replay(trace, scan, 12)
    assert fast.hits == slow.hits and 0 < fast.hits < fast.needed


def each_victim_scan(p: FlashMoEMLPolicy, candidates) -> tuple[ExpertKey, dict[ExpertKey, float]]:
    """flashmoe-ml's victim as it was chosen before its arrays: every layer's network run over that layer's evictable
    residents at each victim; farthest predicted next use, then least recently used, then key order. With the
    distances it predicted."""
    best, best_rank, predicted = None, None, {}
    for layer in {k.layer for k in p.resident if k in candidates}:
        mine = [k for k in p.resident if k in candidates and k.layer == layer]
        row, experts = p.row[layer], np.array([k.expert for k in mine])
        x = features(p.step, p.last_step[row][experts], p.count[row][experts], float(p.count[row].max()))
        for key, distance in zip(mine, p.model.layers[layer](x).tolist()):
            predicted[key] = distance
            rank = (-distance, p.last_use.get(key, 0), key)
            if best_rank is None or rank < best_rank:
                best, best_rank = key, rank
    return best, predicted


@pytest.mark.parametrize("shapes", ["alike", "differing"])
def test_flashmoe_ml_predicted_once_a_step_evicts_as_its_networks_run_at_each_victim(shapes):
    """The distances kept as arrays (one batched product over the layers, or one product a layer where their
    networks differ in shape), made again only when a step or a use changes their features, choose every victim
    of a replay as each layer's network run over its residents at each victim did — or one whose distance that run
    predicted equal to its victim's but for the last bits (a product over a layer's residents rounds apart from one
    over all its experts now and then: a tie then falls to recency)."""
    rng = np.random.default_rng(1)
    n, layers, experts, k = 240, 4, 16, 2
    skew = rng.dirichlet(np.full(experts, 0.3), size=layers)  # [L, E]
    ids = np.stack([[rng.choice(experts, k, replace=False, p=skew[j]) for j in range(layers)] for _ in range(n)])
    trace = Trace("hand-made", layers, experts, k, list(range(layers)), np.repeat(np.arange(3), 80).astype(np.int32),
                  np.tile(np.arange(80), 3).astype(np.int32), np.full(n, DECODE, np.uint8), ids.astype(np.int16),
                  np.full(ids.shape, 0.5, np.float16))
    ctx = PolicyContext(12, tuple(range(layers)), experts, k)
    model = networks(ctx.layers)
    if shapes == "differing":  # one layer's network wider: no stacking
        model.layers[2] = networks([2], (2, 16, 1), seed=5).layers[2]
    fast = FlashMoEMLPolicy(ctx, model)
    assert (fast.stacked is None) == (shapes == "differing")
    chosen = []
    fast_victim = fast.victim
    fast.victim = lambda candidates: chosen.append((fast_victim(candidates), each_victim_scan(fast, candidates))) \
        or chosen[-1][0]
    result = replay(trace, fast, 12)
    assert len(chosen) > 100
    for victim, (scanned, predicted) in chosen:
        assert victim == scanned or predicted[victim] == pytest.approx(predicted[scanned], rel=1e-5, abs=1e-6)
    assert sum(victim == scanned for victim, (scanned, _) in chosen) > 0.99 * len(chosen)
    assert 0 < result.hits < result.needed


def test_belady_kept_next_uses_follow_time_back_to_the_start_of_a_replay():
    """The array moves each expert's next use on as time passes it; a replay begun again (time back to its start)
    gets every expert's next use again, as the search of its future would give."""
    p = BeladyPolicy(CTX, random_future(CTX, seed=3))
    for step in (40, 1):
        p.on_route(route(LAYERS[0], step, [0], [1.0], 0))
        priorities = p.priorities()
        assert [priorities[p.row[layer], e] for layer in LAYERS for e in range(E)] == \
            [-p.next_use(ExpertKey(layer, e)) for layer in LAYERS for e in range(E)]


def test_belady_with_every_expert_used_again_keeps_its_next_uses_as_floats():
    """A future in which every expert has a use (no `never` among the first next uses): once the last use of one
    passes, its next use is `never` (infinite), which an array of integers could not hold."""
    future = {ExpertKey(layer, e): [1 + e] for layer in LAYERS for e in range(E)}
    p = BeladyPolicy(CTX, future)
    for e in range(2):
        p.on_insert(ExpertKey(LAYERS[0], e))
    p.on_route(route(LAYERS[0], 3, [0], [1.0], 0))  # time 6: expert 0's and 1's only uses are past
    assert p.victim({ExpertKey(LAYERS[0], 0), ExpertKey(LAYERS[0], 1)}) == ExpertKey(LAYERS[0], 0)
    assert p.priorities()[p.row[LAYERS[0]], 0] == -float("inf")
