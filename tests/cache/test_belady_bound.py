"""No online policy beats Belady's hit rate at the same capacity and partitioning, on random traces."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.cache.policies import POLICIES, make_policy
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.flashmoe_ml import CacheModel, LayerMLP
from moetier.cache.policies.hobbit import HobbitWeights
from moetier.plan.route import DECODE
from moetier.sim.fit import use_counts
from moetier.sim.replay import next_uses, replay
from moetier.trace.format import Trace


@st.composite
def traces(draw):
    layers = draw(st.integers(1, 3))
    experts = draw(st.integers(2, 6))
    top_k = draw(st.integers(1, min(2, experts)))
    tokens = draw(st.integers(3, 30))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    skew = rng.dirichlet(np.full(experts, 0.5), size=layers)  # [L, E] each layer's preference
    ids = np.stack([[rng.choice(experts, top_k, replace=False, p=skew[j]) for j in range(layers)]
                    for _ in range(tokens)]).astype(np.int16)  # [N, L, k]
    trace = Trace("random", layers, experts, top_k, list(range(layers)), np.zeros(tokens, np.int32),
                  np.arange(tokens, dtype=np.int32), np.full(tokens, DECODE, np.uint8), ids,
                  np.full(ids.shape, 1 / top_k, np.float16))
    per_layer = draw(st.booleans())
    per_layer_slots = draw(st.integers(top_k, experts))
    slots = per_layer_slots * layers if per_layer else draw(st.integers(top_k, layers * experts))
    return trace, slots, per_layer


def params(name, trace):
    if name == "flashmoe-ml":  # any network will do for a bound
        mlp = LayerMLP((np.array([[1.0, -1.0], [0.5, 0.2]]), np.array([[1.0], [-0.5]])), (np.zeros(2), np.zeros(1)))
        return {"model": CacheModel(dict.fromkeys(trace.layers, mlp))}
    if name == "static-hot":
        return {"counts": use_counts(trace)}
    if name == "hobbit":
        return {"weights": HobbitWeights(0.25, 0.25, 0.25, 0.25)}
    return {}


@settings(max_examples=60, deadline=None)
@given(traces())
def test_no_online_policy_beats_belady(case):
    """From the same start: a policy that loads a hot set before the first step is held to Belady starting with
    that set loaded (optimal from any starting cache)."""
    trace, slots, per_layer = case
    ctx = PolicyContext(slots, tuple(trace.layers), trace.num_experts, trace.top_k)
    for name in sorted(set(POLICIES) - {"belady"}):
        policy = make_policy(name, ctx, **params(name, trace))
        belady = make_policy("belady", ctx, future=next_uses(trace))
        belady.start_set = policy.start_set
        best = replay(trace, belady, slots, per_layer=per_layer).hits
        hits = replay(trace, policy, slots, per_layer=per_layer).hits
        assert hits <= best, f"{name} made {hits} hits, Belady {best}"
