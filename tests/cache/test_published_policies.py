"""The published policies as pure logic: hand-made event sequences with known answers, and textbook cases
replayed on hand-made traces."""

import numpy as np
import pytest

from moetier.cache.keys import ExpertKey
from moetier.cache.policies import make_policy
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.hobbit import HobbitWeights
from moetier.plan.route import DECODE, PREFILL, RouteResult
from moetier.sim.replay import replay, trace_policy
from moetier.trace.format import Trace

CTX = PolicyContext(num_slots=3, layers=(0, 1, 2, 3), num_experts=4, top_k=1)
K = {(layer, e): ExpertKey(layer, e) for layer in range(4) for e in range(4)}


def route(layer, step, ids, scores=None, weights=None, phase=DECODE):
    ids = np.asarray(ids, np.int64).reshape(len(ids), -1)  # [T, k]
    w = np.full(ids.shape, 1.0, np.float32) if weights is None else np.asarray(weights, np.float32).reshape(ids.shape)
    s = np.zeros((len(ids), 4), np.float32) if scores is None else np.asarray(scores, np.float32).reshape(len(ids), 4)
    return RouteResult(layer, step, ids, w, s, phase)


def use(policy, key, step=1, precision="bf16", insert=False):
    if insert:
        policy.on_insert(key)
    policy.on_access(key, precision, step)


def one_layer_trace(refs, num_experts=6):
    """A decode-only trace of one layer, top-1: the classic page-reference string."""
    n = len(refs)
    ids = np.asarray(refs, np.int16).reshape(n, 1, 1)
    return Trace("hand-made", 1, num_experts, 1, [0], np.zeros(n, np.int32), np.arange(n, dtype=np.int32),
                 np.full(n, DECODE, np.uint8), ids, np.ones_like(ids, np.float16))


def faults(policy, refs, slots=3):
    trace = one_layer_trace(refs)
    ctx = PolicyContext(slots, (0,), trace.num_experts, 1)
    result = replay(trace, trace_policy(policy, ctx, trace), slots)
    return result.needed - result.hits


# The textbook reference string 1 2 3 4 1 2 5 1 2 3 4 5 with three frames: OPT 7 faults, LRU 10.
TEXTBOOK = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]


def test_belady_and_lru_textbook_fault_counts():
    assert faults("belady", TEXTBOOK) == 7
    assert faults("lru", TEXTBOOK) == 10


def test_lfu_textbook_keeps_the_frequent_page():
    # 1 is used three times up front; a scan of 2..5 then never evicts it under LFU, always under LRU
    refs = [1, 1, 1, 2, 3, 4, 5, 1]
    assert faults("lfu", refs) == 5 and faults("lru", refs) == 6


def test_arc_resists_a_scan_that_flushes_lru():
    # 1 and 2 used twice (T2), then a one-time scan 3 4 5 through a 3-slot cache: ARC evicts from T1 (the
    # scan), so 1 and 2 hit at the end; LRU has flushed them
    refs = [1, 1, 2, 2, 3, 4, 5, 1, 2]
    assert faults("arc", refs) == 5
    assert faults("lru", refs) == 7


def test_arc_grows_t1_after_a_miss_on_its_ghost():
    p = make_policy("arc", PolicyContext(2, (0,), 4, 1))
    a, b, c = K[(0, 0)], K[(0, 1)], K[(0, 2)]
    for key in (a, b):
        p.on_route(route(0, 1, [key.expert]))
        use(p, key, insert=True)
    p.on_route(route(0, 2, [c.expert]))
    assert p.victim({a, b}) == a  # T1, least recent
    p.on_evict(a)
    use(p, c, insert=True)
    assert a in p.b1 and p.p == 0
    p.on_route(route(0, 3, [a.expert]))  # a miss on a ghost of T1
    assert p.p == 1


def test_lfu_seq_forgets_at_each_sequence():
    p = make_policy("lfu-seq", CTX)
    a, b = K[(0, 0)], K[(0, 1)]
    use(p, a, insert=True)
    use(p, a)
    use(p, b, insert=True)
    assert p.victim({a, b}) == b
    p.on_sequence_start()
    use(p, b)
    assert p.victim({a, b}) == a  # a's two uses belonged to the last sequence


def test_fld_evicts_the_layer_computed_last():
    p = make_policy("fld", CTX)
    keys = [K[(layer, 0)] for layer in range(4)]
    for key in keys:
        use(p, key, insert=True)
    p.on_route(route(2, 2, [1]))  # computing layer 2: layer 1 runs again only after 3, 0
    assert p.victim(set(keys)) == K[(1, 0)]
    assert p.victim({K[(3, 0)], K[(0, 0)]}) == K[(0, 0)]


def test_lhu_counts_only_full_precision_uses():
    p = make_policy("lhu", CTX)
    a, b = K[(0, 0)], K[(0, 1)]
    use(p, a, insert=True, precision="int4")
    use(p, a, precision="int4")
    use(p, b, insert=True)
    assert p.victim({a, b}) == a  # two uses, both at int4


def test_hobbit_with_one_weight_is_that_policy():
    a, b = K[(0, 0)], K[(1, 0)]
    lru = make_policy("hobbit", CTX, weights=HobbitWeights(1, 0, 0, 0))
    fld = make_policy("hobbit", CTX, weights=HobbitWeights(0, 0, 0, 1))
    for p in (lru, fld):
        use(p, b, insert=True)
        use(p, a, insert=True)
        p.on_route(route(1, 2, [1]))  # computing layer 1: layer 0 is the farthest ahead
    assert lru.victim({a, b}) == b and fld.victim({a, b}) == a


def test_hobbit_priority_is_equation_3():
    p = make_policy("hobbit", CTX, weights=HobbitWeights(0.4, 0.3, 0.2, 0.1))
    a, b = K[(1, 0)], K[(3, 1)]
    p.on_route(route(0, 1, [0, 1, 2]))  # a prefill of three tokens: T = 3
    use(p, a, insert=True, precision="bf16")
    p.on_route(route(1, 1, [0, 1, 2]))  # the same step's next layer: still T = 3
    use(p, b, insert=True, precision="int4")
    p.on_route(route(0, 2, [0]))  # a decode step: T = 4
    use(p, a, step=2, precision="int4")
    p.on_admit(K[(2, 3)])  # making room for an expert of layer 2: l_i = 2, l_n = 4
    # a: R = 4, F = 2, H = 1 (the int4 use is low), layer 1 is (1 - 2 + 4) % 4 = 3 layers from 2
    assert p.priority(a) == pytest.approx(0.4 * 4 / 4 + 0.3 * 2 / 4 + 0.2 * 1 / 4 + 0.1 * (1 - 3 / 4))
    # b: R = 3, F = 1, H = 0, layer 3 is one layer from 2
    assert p.priority(b) == pytest.approx(0.4 * 3 / 4 + 0.3 * 1 / 4 + 0.1 * (1 - 1 / 4))


@pytest.mark.parametrize("name, params", [("hobbit", {"weights": HobbitWeights(0, 0, 0, 1)}), ("fld", {})])
def test_fld_counts_from_the_layer_being_inserted(name, params):
    """HOBBIT's l term, and `fld` alone like it: from the layer computed for an on-demand load, from a prefetch's own
    layer."""
    keys = {K[(1, 0)], K[(3, 0)]}
    p = make_policy(name, CTX, **params)
    for key in keys:
        use(p, key, insert=True)
    p.on_route(route(0, 1, [0]))  # computing layer 0: layer 3 runs last
    assert p.victim(keys) == K[(3, 0)]
    p.on_admit(K[(2, 0)])  # a prefetch for layer 2: from there layer 1 runs last
    assert p.victim(keys) == K[(1, 0)]


def test_hobbit_records_reset_with_each_sequence():
    p = make_policy("hobbit", CTX, weights=HobbitWeights(0, 1, 0, 0))
    a, b = K[(0, 0)], K[(0, 1)]
    p.on_route(route(0, 1, [0]))
    for _ in range(3):
        use(p, a, insert=True)
    p.on_sequence_start()
    p.on_route(route(0, 2, [1]))
    use(p, b, insert=True)
    assert p.tokens == 1 and p.victim({a, b}) == a  # a's three uses belonged to the last sequence


def test_lhu_counts_the_configured_high_precision_only():
    ctx = PolicyContext(3, (0, 1, 2, 3), 4, 1, high_precision="int8")  # HOBBIT's int8 + int2 pair
    for name in ("lhu", "hobbit"):
        p = make_policy(name, ctx, **({"weights": HobbitWeights(0, 0, 1, 0)} if name == "hobbit" else {}))
        a, b = K[(0, 0)], K[(0, 1)]
        use(p, a, insert=True, precision="int8")
        use(p, b, insert=True, precision="int2")
        use(p, b, precision="int2")
        assert p.victim({a, b}) == b  # two uses of b, both at the low precision
    assert not CTX.is_high("int8") and CTX.is_high("bf16")  # no pair configured: int8 is a quantized copy


def test_hobbit_reads_fitted_weights_saved_with_the_model(tmp_path):
    import json

    from moetier.policy_files import make_policy_for_model

    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "hobbit.json").write_text(json.dumps({"weights": {"lru": 0, "lfu": 1, "lhu": 0,
                                                                               "fld": 0}}))
    ctx = PolicyContext(3, (0,), 4, 1)
    assert make_policy_for_model("hobbit", ctx, tmp_path).weights == HobbitWeights(0, 1, 0, 0)


def test_smoe_score_keeps_an_expert_the_router_rates_highly_without_selecting_it():
    p = make_policy("smoe-score", CTX)
    a, b = K[(0, 0)], K[(0, 1)]
    use(p, a, insert=True)
    use(p, b, insert=True)
    for step in range(2, 6):  # expert 0 is selected with a middling score; expert 1 scored 0.45, unselected
        p.on_route(route(0, step, [0], scores=[0.5, 0.45, 0.05, 0.0]))
    p.on_route(route(0, 6, [2], scores=[0.05, 0.4, 0.55, 0.0]))
    assert p.victim({a, b}) == a  # mean 0.41 against 0.44


def test_smoe_score_window_counts_decode_tokens_and_ignores_prefill():
    """Eq. 3 per token: a batch step of three tokens enters three rows of a window of 3; a prompt enters none."""
    p = make_policy("smoe-score", CTX, window=3)
    a, b = K[(0, 0)], K[(0, 1)]
    use(p, a, insert=True)
    use(p, b, insert=True)
    p.on_route(route(0, 1, [0] * 8, scores=[[0.0, 1.0, 0.0, 0.0]] * 8, phase=PREFILL))  # the prompt: not counted
    assert p.priority(a) == p.priority(b) == 0.0
    p.on_route(route(0, 2, [0], scores=[1.0, 0.0, 0.0, 0.0]))  # one token: a scores 1
    p.on_route(route(0, 3, [1, 1], scores=[[0.0, 1.0, 0.0, 0.0]] * 2))  # two tokens: b scores 1 twice
    assert p.priority(a) == pytest.approx(1 / 3) and p.priority(b) == pytest.approx(2 / 3)
    p.on_route(route(0, 4, [1, 1, 1], scores=[[0.0, 1.0, 0.0, 0.0]] * 3))  # three more rows push a's out
    assert p.priority(a) == 0.0 and p.priority(b) == pytest.approx(1.0)
    assert p.victim({a, b}) == a
    p.on_sequence_start()  # Eq. 3's j counts a sequence's generations
    assert p.priority(b) == 0.0


def test_comoe_weighs_recent_use_and_importance():
    p = make_policy("comoe", CTX)
    a, b = K[(0, 0)], K[(0, 1)]
    use(p, a, insert=True)
    use(p, b, insert=True)
    for step in range(2, 10):  # expert 0 keeps being selected with weight 0.9; expert 1 never
        p.on_route(route(0, step, [0], weights=[0.9]))
    assert p.victim({a, b}) == b


def test_comoe_score_is_equation_38_with_the_predictors_probability():
    p = make_policy("comoe", CTX)
    a, b = K[(0, 0)], K[(0, 1)]
    use(p, a, insert=True)
    use(p, b, insert=True)
    for step in range(2, 10):  # both selected alike: equal frequency and importance
        p.on_route(route(0, step, [0, 1], weights=[0.5, 0.5]))
    assert p.next_use_source == "recent use (no predictor)"
    p.on_predict({0: np.array([[0.1, 0.7, 0.1, 0.1]], np.float32)})  # the predictor expects expert 1
    assert p.next_use_source == "the predictor"
    _, freq, importance = p.terms(0)
    f, i = freq[0], importance[0]
    f_mean, i_mean = freq.mean(), importance.mean()  # experts 2 and 3 never used: half of a's
    assert f_mean == pytest.approx(f / 2) and i_mean == pytest.approx(i / 2)
    # Eq. 38 with each reciprocal normalised as x̄/(x + x̄): here 1/3 for both of a's
    assert p.evict_score(a) == pytest.approx(0.5 * (1 - 0.1) + 0.5 * (0.5 / 3 + 0.5 / 3))
    assert p.victim({a, b}) == a  # the one the predictor gives less to leaves


def test_comoe_terms_share_one_scale():
    """The predictor's term can decide now: an expert used a little less than another, but predicted for the next
    layer, is kept (as printed, 1/f_recent's hundreds would drown a probability)."""
    p = make_policy("comoe", CTX)
    a, b = K[(0, 0)], K[(0, 1)]
    use(p, a, insert=True)
    use(p, b, insert=True)
    for step in range(2, 12):  # a every step, b every other step
        p.on_route(route(0, step, [0, 1] if step % 2 else [0], weights=[0.5, 0.5] if step % 2 else [0.5]))
    p.on_predict({0: np.array([[0.05, 0.9, 0.025, 0.025]], np.float32)})
    assert p.victim({a, b}) == a
    scores = [p.evict_score(K[(0, e)]) for e in range(4)]
    assert all(0 <= s <= 1 for s in scores)
    p.on_sequence_start()
    assert p.next_use_source == "recent use (no predictor)"


def test_lecar_learns_against_the_policy_that_caused_misses():
    p = make_policy("lecar", PolicyContext(2, (0,), 4, 1))
    a, b, c = K[(0, 0)], K[(0, 1)], K[(0, 2)]
    use(p, a, insert=True)
    use(p, a)
    use(p, b, insert=True)
    p.rng.random = lambda: 0.0  # the draw picks LRU
    victim = p.victim({a, b})
    assert victim == a
    p.on_evict(a)
    use(p, c, insert=True)
    before = p.w_lru
    p.on_evict(b)
    use(p, a, insert=True)  # a miss on what LRU evicted
    assert p.w_lru < before


def test_static_hot_never_evicts_a_hot_expert_while_a_cold_one_can_go():
    counts = {K[(0, 0)]: 10, K[(0, 1)]: 9, K[(0, 2)]: 1}
    p = make_policy("static-hot", CTX, counts=counts)  # 3 slots, top-1: the two hottest stay
    for key in (K[(0, 2)], K[(0, 0)], K[(0, 1)]):
        use(p, key, insert=True)
    assert p.hot == {K[(0, 0)], K[(0, 1)]}
    assert p.victim({K[(0, 0)], K[(0, 1)], K[(0, 2)]}) == K[(0, 2)]
    assert p.victim({K[(0, 0)], K[(0, 1)]}) == K[(0, 1)]


def test_belady_needs_the_future_and_learned_policies_their_weights():
    from moetier.errors import MoetierError

    with pytest.raises(MoetierError, match="offline optimum"):
        make_policy("belady", CTX)
    for name in ("flashmoe-ml", "hobbit", "static-hot"):
        with pytest.raises(MoetierError, match=f"train cache-policy --policy {name}"):
            make_policy(name, CTX)


def test_flashmoe_ml_learns_a_periodic_pattern_lru_gets_wrong():
    # A loop over 4 experts through 3 slots: LRU always evicts the one needed next (every access misses);
    # Belady's targets teach the network that the most recently used is needed last.
    from moetier.sim.fit import train_flashmoe

    refs = [0, 1, 2, 3] * 60
    model = train_flashmoe(one_layer_trace(refs))
    test = one_layer_trace(refs[:80])
    ctx = PolicyContext(3, (0,), 6, 1)
    ml = replay(test, make_policy("flashmoe-ml", ctx, model=model), 3)
    assert faults("lru", refs[:80]) == 80
    assert ml.needed - ml.hits < 40


def test_a_per_layer_cache_evicts_only_within_the_layer():
    from moetier.cache.policies import LRUPolicy
    from moetier.cache.residency import Residency

    r = Residency(4, {"bf16": 1}, LRUPolicy(), layers=(0, 1))  # room for two experts per layer
    for key in (K[(0, 0)], K[(0, 1)], K[(1, 0)]):
        r.admit(key, "bf16")
        r.landed(key)
    r.unpin_all()
    assert r.has_room(1, 1) and not r.has_room(0, 1)
    slot, evicted = r.admit(K[(0, 2)], "bf16")  # room remains, but it is layer 1's
    assert evicted == (K[(0, 0)],) and slot == r.entries[K[(0, 2)]].slot
    r.admit(K[(1, 1)], "bf16")
    r.landed(K[(0, 2)])
    r.landed(K[(1, 1)])
    r.unpin_all()
    assert r.admit(K[(1, 2)], "bf16")[1] == (K[(1, 0)],)
    r.pin(K[(0, 1)])
    r.pin(K[(0, 2)])
    assert r.admit(K[(0, 3)], "bf16") is None  # layer 0's experts are all pinned; layer 1's are not taken


def test_flashmoe_ml_refuses_a_network_that_does_not_chain_and_an_earlier_file():
    import numpy as np

    from moetier.cache.policies.flashmoe_ml import LayerMLP
    from moetier.errors import MoetierError

    with pytest.raises(ValueError, match="must chain 2 features to 1 output"):
        LayerMLP((np.zeros((2, 4)), np.zeros((3, 1))), (np.zeros(4), np.zeros(1)))
    with pytest.raises(MoetierError, match="train it again"):
        LayerMLP.from_json({"w1": [[1.0]], "b1": [0.0], "w2": [1.0], "b2": 0.0})


def test_flashmoe_ml_runs_in_float32_and_a_deep_negative_activation_is_silus_limit_without_a_warning():
    """The networks run in float32 (as trained, as their file keeps them); exp(-x) overflows there below x = -88, which
    must give silu's limit, 0, and no RuntimeWarning on a user's terminal."""
    import warnings

    import numpy as np

    from moetier.cache.policies.flashmoe_ml import LayerMLP

    net = LayerMLP((np.full((2, 4), 100.0), np.ones((4, 1))), (np.zeros(4), np.zeros(1)))  # float64 given
    assert {w.dtype for w in net.weights + net.biases} == {np.dtype(np.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = net(np.array([[-1.0, -1.0], [0.01, 0.0]]))  # pre-activations -200 (exp overflows) and 1
    assert out.dtype == np.float32 and out[0] == 0.0 and out[1] == pytest.approx(4 / (1 + np.exp(-1.0)))


def test_static_hot_ranks_by_tokens_processed_and_starts_with_the_hot_set_loaded():
    """PreScope's hot table: ranked by tokens (a prefill of many tokens on one expert counts each), the hottest
    loaded before the first step, so their first use is a hit."""
    from moetier.sim.fit import use_counts

    profile = one_layer_trace([4, 4, 4, 2, 2, 5])
    counts = use_counts(profile)
    assert counts == {ExpertKey(0, 4): 3, ExpertKey(0, 2): 2, ExpertKey(0, 5): 1}
    ctx = PolicyContext(3, (0,), 6, 1)  # 3 slots, top-1: a hot set of 2
    policy = make_policy("static-hot", ctx, counts=counts)
    assert policy.start_set() == (ExpertKey(0, 4), ExpertKey(0, 2))
    result = replay(one_layer_trace([2, 4, 1, 2]), policy, 3)
    assert result.hits == 3  # 2 and 4 from the start, 2 again; only 1 misses
    assert replay(one_layer_trace([2, 4, 1, 2]), make_policy("lru", ctx), 3).hits == 1


def test_predicted_spares_what_the_predictor_names_and_forwards_every_event():
    """LRU in a cache shared by layers evicts the next layer's experts (used a step ago, the oldest); told the
    prediction, `lru+predicted` evicts the oldest expert that is not predicted, and falls back to LRU's choice
    when everything evictable is predicted."""
    ctx = PolicyContext(4, (0, 1), 4, 1)
    policy = make_policy("lru+predicted", ctx)
    assert policy.name == "lru+predicted"
    for step, key in enumerate([ExpertKey(1, 0), ExpertKey(1, 1), ExpertKey(0, 2), ExpertKey(0, 3)], 1):
        policy.on_insert(key)
        policy.on_access(key, "bf16", step)
    everything = {ExpertKey(1, 0), ExpertKey(1, 1), ExpertKey(0, 2), ExpertKey(0, 3)}
    assert policy.victim(everything) == ExpertKey(1, 0)  # nothing predicted yet: LRU
    policy.on_predict({1: np.array([[0.1, 0.9, 0.0, 0.0], [0.8, 0.1, 0.0, 0.0]], np.float32)})  # tokens: 1, 0
    assert policy.victim(everything) == ExpertKey(0, 2)
    assert policy.victim({ExpertKey(1, 0), ExpertKey(1, 1)}) == ExpertKey(1, 0)  # only predicted ones: LRU's
    policy.on_evict(ExpertKey(1, 0))
    assert ExpertKey(1, 0) not in policy.base._order
    policy.on_sequence_start()
    assert policy.victim(everything - {ExpertKey(1, 0)}) == ExpertKey(1, 1)  # a new sequence forgets it


def test_a_predicted_learned_policy_still_needs_its_parameters():
    from moetier.errors import MoetierError

    with pytest.raises(MoetierError, match="train cache-policy --policy static-hot"):
        make_policy("static-hot+predicted", PolicyContext(4, (0,), 4, 1))
    hot = make_policy("static-hot+predicted", PolicyContext(4, (0,), 4, 1), counts={ExpertKey(0, 1): 5})
    assert hot.start_set() == (ExpertKey(0, 1),)


def test_flashmoe_ml_networks_round_trip_through_their_file_and_a_damaged_one_is_refused(tmp_path):
    import json

    from moetier.cache.policies.flashmoe_ml import CacheModel, LayerMLP
    from moetier.errors import MoetierError
    from moetier.policy_files import load_params, save_params

    rng = np.random.default_rng(0)
    mlp = LayerMLP((rng.normal(size=(2, 8)), rng.normal(size=(8, 1))), (rng.normal(size=8), rng.normal(size=1)))
    path = tmp_path / "policies" / "flashmoe-ml.json"
    save_params("flashmoe-ml", path, {"model": CacheModel({0: mlp}, "t")}, "t")
    back = load_params("flashmoe-ml", tmp_path)["model"].layers[0]
    x = rng.random((6, 2))
    np.testing.assert_allclose(back(x), mlp(x), atol=1e-2)  # stored in float16
    d = json.loads(path.read_text())
    d["layers"]["0"]["weights"][0]["float16"] = "not base64!"
    path.write_text(json.dumps(d))
    with pytest.raises(MoetierError, match="malformed"):
        load_params("flashmoe-ml", tmp_path)


def test_lhu_counts_are_the_sequences():
    """Eq. 3's H_t counts the uses of this sequence: the last sequence's many uses do not keep an expert."""
    p = make_policy("lhu", CTX)
    a, b = K[(0, 0)], K[(0, 1)]
    use(p, a, insert=True)
    use(p, a)
    use(p, a)
    p.on_sequence_start()
    use(p, b, insert=True)
    assert p.victim({a, b}) == a
