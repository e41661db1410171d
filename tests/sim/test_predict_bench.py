"""predict-bench and the simulator's predictors on hand-made traces: the oracle is perfect at every distance, a
hot table is exactly as good as the routing is skewed, and the oracle's steps line up with the replay's."""

import numpy as np

from moetier.cache.policies import LRUPolicy
from moetier.sim.cost import FreeCost
from moetier.sim.predict_bench import evaluate, predict_bench
from moetier.sim.predictors import trace_counts, trace_predictor, trace_truth
from moetier.sim.replay import simulate
from moetier.trace.format import Trace

E, K, LAYERS = 8, 2, [0, 1, 2, 3]


def trace(tokens=40, seed=0, fixed=False) -> Trace:
    """Two sequences, each a prefill of 4 tokens then decode steps; random routing, or layer l always l, l+1."""
    rng = np.random.default_rng(seed)
    if fixed:
        ids = np.array([[[j, j + 1] for j in LAYERS]] * tokens, np.int16)
    else:
        ids = np.stack([[rng.choice(E, K, replace=False) for _ in LAYERS] for _ in range(tokens)]).astype(np.int16)
    half = tokens // 2
    seq = np.repeat([0, 1], [half, tokens - half]).astype(np.int32)
    pos = np.concatenate([np.arange(half), np.arange(tokens - half)]).astype(np.int32)
    phase = (pos >= 4).astype(np.uint8)
    return Trace("m", len(LAYERS), E, K, list(LAYERS), seq, pos, phase, ids, np.full(ids.shape, 0.5, np.float16))


def test_the_oracle_is_perfect_at_every_distance():
    t = trace()
    records = evaluate(t, trace_predictor("oracle", t, distance=3), "oracle", "t")
    assert [r.distance for r in records] == [1, 2, 3]
    assert all(r.recall == 1.0 for r in records)
    assert records[0].pairs == sum(t.phase) * 3  # each decode step, from each layer with one ahead


def test_hot_is_perfect_on_fixed_routing_and_middling_on_random():
    fixed, rand = trace(fixed=True), trace(tokens=400)
    (hot_fixed,) = predict_bench({"f": fixed}, {"hot": lambda train, whole: trace_predictor(
        "hot", whole, counts=trace_counts(train))}, progress=False)
    assert hot_fixed.recall == 1.0
    (hot_rand,) = predict_bench({"r": rand}, {"hot": lambda train, whole: trace_predictor(
        "hot", whole, counts=trace_counts(train))}, progress=False)
    assert 0.1 < hot_rand.recall < 0.5  # about k/E = 0.25 on uniform routing


def test_the_oracles_truth_follows_the_replays_step_numbers():
    t = trace()
    truth = trace_truth(t)
    assert (truth(1, 2) == t.topk_ids[0:4, 2]).all()  # step 1: the first prefill, 4 tokens
    assert (truth(2, 0) == t.topk_ids[4:5, 0]).all()  # step 2: the first decode token


def test_prefetching_with_the_oracle_on_a_free_machine_changes_no_hit():
    """Prefetched reads land at once on a free machine: a perfect predictor turns misses into hits, never
    the other way round (prefetch pins leave room for every layer's misses)."""
    t = trace(tokens=200)
    base = simulate(t, LRUPolicy(), 10, FreeCost())
    pre = simulate(t, LRUPolicy(), 10, FreeCost(), prefetch="hobbit", predictor=trace_predictor("oracle", t))
    assert pre.hits > base.hits
    s = pre.summary()["prefetches"]
    assert s["issued"] > 0 and s["wasted"] == 0 and s["late"] == 0 and s["used"] == s["issued"]
