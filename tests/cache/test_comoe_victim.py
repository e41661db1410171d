"""CoMoE's victim from its score arrays is the victim ScoredPolicy's scan of every resident names: highest Eq. 38
score, then least recently used, then key order — on random event sequences, and over a whole replay; and its
moving averages, absorbed many routes at once, are the route-by-route ones."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.comoe import CoMoEPolicy
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.scored import ScoredPolicy
from moetier.plan.route import DECODE, RouteResult
from moetier.sim.replay import replay
from moetier.trace.format import Trace

LAYERS = (3, 1, 5)  # execution order unlike key order, so the last tie-break is tried
E = 6
CTX = PolicyContext(8, LAYERS, E, 2)


class ScanningCoMoE(CoMoEPolicy):
    """The same policy choosing by the scan every ScoredPolicy makes."""

    def victim(self, candidates):
        return ScoredPolicy.victim(self, candidates)


def route(layer: int, step: int, ids: list[int], weights: list[float]) -> RouteResult:
    topk_ids = np.asarray(ids, np.int64).reshape(1, -1)  # [T, k]
    topk_weights = np.asarray(weights, np.float32).reshape(1, -1)
    return RouteResult(layer, step, topk_ids, topk_weights, np.zeros((1, E), np.float32), DECODE)


events = st.lists(st.tuples(st.sampled_from(["route", "insert", "evict", "access", "predict", "sequence", "victim"]),
                            st.sampled_from(LAYERS), st.integers(0, E - 1), st.integers(0, E - 1),
                            st.floats(0.05, 1.0), st.integers(0, 2**16)), min_size=1, max_size=120)


@settings(max_examples=150, deadline=None)
@given(events)
@example([("insert", 3, 4, 0, 0.5, 0), ("insert", 3, 1, 0, 0.5, 0), ("access", 3, 4, 0, 0.5, 0),
          ("access", 3, 1, 0, 0.5, 0), ("victim", 3, 0, 0, 0.5, 5)])  # a tie in score: the least recent leaves
def test_the_arrays_name_the_scans_victim(seq):
    p = CoMoEPolicy(CTX)
    for step, (kind, layer, a, b, w, draw) in enumerate(seq):
        key = ExpertKey(layer, a)
        if kind == "route":
            p.on_route(route(layer, step, sorted({a, b}), [w, 1 - w][:len({a, b})]))
        elif kind == "insert" and key not in p.resident:
            p.on_insert(key)
        elif kind == "evict" and key in p.resident:
            p.on_evict(key)
        elif kind == "access":
            p.on_access(key, "bf16", step)
        elif kind == "predict":
            scores = np.random.default_rng(draw).random((2, E)).astype(np.float32)  # [T, E]
            p.on_predict({layer: scores})
        elif kind == "sequence":
            p.on_sequence_start()
        elif kind == "victim" and p.resident:
            rng = np.random.default_rng(draw)
            candidates = {k for k in p.resident if rng.random() < 0.7} or set(p.resident)
            assert p.victim(candidates) == ScoredPolicy.victim(p, candidates)
        scores = p.fresh_scores()
        for layer_ in LAYERS:  # the arrays are Eq. 38's scores, float for float
            assert list(scores[p.row[layer_]]) == [p.evict_score(ExpertKey(layer_, e)) for e in range(E)]


def test_a_replay_makes_the_same_choices_either_way():
    rng = np.random.default_rng(0)
    n, layers, experts, k = 300, 4, 16, 2
    skew = rng.dirichlet(np.full(experts, 0.3), size=layers)  # [L, E] each layer's favourites
    ids = np.stack([[rng.choice(experts, k, replace=False, p=skew[j]) for j in range(layers)] for _ in range(n)])
    trace = Trace("hand-made", layers, experts, k, list(range(layers)), np.repeat(np.arange(3), 100).astype(np.int32),
                  np.tile(np.arange(100), 3).astype(np.int32), np.full(n, DECODE, np.uint8), ids.astype(np.int16),
                  np.full(ids.shape, 0.5, np.float16))
    ctx = PolicyContext(12, tuple(range(layers)), experts, k)
    fast, scan = replay(trace, CoMoEPolicy(ctx), 12), replay(trace, ScanningCoMoE(ctx), 12)
    assert fast.hits == scan.hits and 0 < fast.hits < fast.needed


def route_by_route(routes, experts, fast=1 / 8, slow=1 / 64):
    """recent use, frequency and importance [E] updated one route at a time, as Eq. 38's terms are defined."""
    recent, freq, importance = np.zeros(experts), np.zeros(experts), np.zeros(experts)
    for r in routes:
        ids, weights = r.topk_ids.ravel(), r.topk_weights.ravel().astype(np.float64)
        used = np.zeros(experts)
        used[ids] = 1.0
        recent += fast * (used - recent)
        freq += slow * (used - freq)
        for e in np.unique(ids):
            importance[e] += fast * (weights[ids == e].mean() - importance[e])
    return recent, freq, importance


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(LAYERS), st.integers(1, 3), st.integers(0, 2**16), st.booleans()),
                min_size=1, max_size=300), st.integers(1, 40), st.integers(2, 60))
def test_routes_absorbed_at_once_are_the_averages_route_by_route(events, held, held_ids):
    """Routes of one to three tokens (an expert picked by several tokens gets the mean of their gates) to three
    layers, absorbed in batches of `held` routes or `held_ids` ids, or when a victim is chosen (every layer's at
    once), or when asked."""
    p = CoMoEPolicy(CTX)
    p.held_routes, p.held_ids = held, held_ids
    routes = {layer: [] for layer in LAYERS}
    for step, (layer, tokens, draw, evicting) in enumerate(events):
        rng = np.random.default_rng(draw)
        ids = np.stack([rng.choice(E, 2, replace=False) for _ in range(tokens)])  # [T, k]
        routes[layer].append(RouteResult(layer, step, ids, rng.random(ids.shape).astype(np.float32),
                                         np.zeros((tokens, E), np.float32), DECODE))
        p.on_route(routes[layer][-1])
        row = p.row[layer]
        assert len(p.routes[row]) < held and p.ids_held[row] == sum(len(ids) for ids, _ in p.routes[row]) < held_ids
        if evicting:
            p.fresh_scores()
            assert not any(p.routes)
    for layer in LAYERS:
        want = route_by_route(routes[layer], E)
        for w, g in zip(want, p.terms(layer)):
            np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)
