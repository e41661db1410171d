"""CoMoE's moving averages, absorbed many routes at once, are the route-by-route ones (its victim against the scan:
test_array_victim.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.cache.policies.comoe import CoMoEPolicy
from moetier.cache.policies.context import PolicyContext
from moetier.plan.route import DECODE, RouteResult

LAYERS = (3, 1, 5)  # execution order unlike key order, so the last tie-break is tried
E = 6
CTX = PolicyContext(8, LAYERS, E, 2)


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
