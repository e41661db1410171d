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


def test_the_simulator_prefetches_at_the_loaders_precision_under_hobbit():
    """Mixed-precision prefetch in the simulator (the engine's test: tests/engine/test_prefetch.py): under HOBBIT's
    loader a token's second expert, weighted 0.2, is read at int4 (s = 0.8 > T1), the first at bf16."""
    from moetier.plan.precision import MixedPrecision

    t = trace(tokens=120)
    t.topk_weights[..., 0], t.topk_weights[..., 1] = 0.8, 0.2
    mixed = MixedPrecision("hobbit", low="int4")
    pre = simulate(t, LRUPolicy(), 10, FreeCost({"bf16": 4, "int4": 1}, "bf16"), "bf16", prefetch="hobbit",
                   predictor=trace_predictor("oracle", t), mixed=mixed, keep_plans=True)
    first = {(plan.route.step, plan.layer, int(e)) for plan in pre.plans for e in plan.route.topk_ids[:, 0]}
    read = [(plan.route.step, p.key, p.precision) for plan in pre.plans for p in plan.prefetches]
    assert {"bf16", "int4"} <= {precision for _, _, precision in read}
    # bf16 exactly where some token's predicted (here: true) first expert, int4 where only ever a second
    assert all((precision == "bf16") == ((step, key.layer, key.expert) in first) for step, key, precision in read)
    assert pre.summary()["prefetches"]["issued"] == len(read) > 0
