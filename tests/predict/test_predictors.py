import numpy as np
import pytest

from moetier.plan.route import RouteResult
from moetier.predict.hot import HotPredictor
from moetier.predict.oracle import OraclePredictor
from moetier.predict.quality import recall

LAYERS, E, K = (0, 1, 2, 3), 16, 4


def route(layer: int, step: int, ids) -> RouteResult:
    ids = np.asarray(ids)
    return RouteResult(layer, step, ids, np.full(ids.shape, 1.0 / K, np.float32), np.zeros((len(ids), E), np.float32))


def truth_table(steps: int = 5, tokens: int = 2, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {(s, layer): np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)])
            for s in range(steps) for layer in LAYERS}


def test_future_layers_stop_at_the_last_moe_layer():
    p = HotPredictor((1, 3, 5), E, K, {1: np.ones(E), 3: np.ones(E), 5: np.ones(E)}, distance=2)
    assert p.future_layers(1) == (3, 5) and p.future_layers(3) == (5,) and p.future_layers(5) == ()
    with pytest.raises(ValueError, match="distance"):
        HotPredictor((1,), E, K, {1: np.ones(E)}, distance=0)


def test_hot_names_each_layer_s_most_used_experts_for_every_token():
    counts = {layer: np.bincount([layer, layer, layer + 5], minlength=E) for layer in LAYERS}
    p = HotPredictor(LAYERS, E, K, counts, distance=2)
    out = p.predict(0, np.zeros((3, 8)))
    assert sorted(out) == [1, 2]
    assert out[1].shape == (3, E) and np.argmax(out[1][0]) == 1 and np.argmax(out[2][2]) == 2
    with pytest.raises(ValueError, match=r"no use counts for layers \[3\]"):
        HotPredictor(LAYERS, E, K, {0: np.ones(E), 1: np.ones(E), 2: np.ones(E)})


def test_oracle_without_errors_is_exact_and_keeps_the_router_order():
    truth = truth_table()
    p = OraclePredictor(LAYERS, E, K, lambda s, layer: truth[(s, layer)], distance=3)
    p.observe(0, None, route(0, 2, truth[(2, 0)]))
    out = p.predict(0, None)
    assert sorted(out) == [1, 2, 3]
    for layer, scores in out.items():
        assert recall(scores, truth[(2, layer)]) == 1.0
        assert np.argsort(-scores, axis=1)[:, :K].tolist() == truth[(2, layer)].tolist()


@pytest.mark.parametrize("error_rate", [0.25, 1.0])
def test_oracle_errors_move_that_share_of_pairs_to_unused_experts(error_rate):
    truth = truth_table(steps=400)
    p = OraclePredictor(LAYERS, E, K, lambda s, layer: truth[(s, layer)], error_rate=error_rate, seed=1)
    recalls = []
    for s in range(400):
        p.observe(0, None, route(0, s, truth[(s, 0)]))
        scores = p.predict(0, None)[1]
        assert ((scores > 0).sum(1) == K).all()  # still k distinct experts a token
        recalls.append(recall(scores, truth[(s, 1)]))
    assert np.mean(recalls) == pytest.approx(1 - error_rate, abs=0.03)


def test_oracle_refuses_impossible_settings():
    with pytest.raises(ValueError, match="error_rate"):
        OraclePredictor(LAYERS, E, K, lambda s, layer: None, error_rate=1.5)
    with pytest.raises(ValueError, match="at least 2 top_k"):
        OraclePredictor(LAYERS, 2 * K - 1, K, lambda s, layer: None, error_rate=0.1)


def test_a_merged_models_predictions_sum_each_group_onto_its_principal():
    """GroupedPredictor: the inner predictor's scores [T, E], each column added into its principal's, merged-away ids
    0 — what the merged router does to the probabilities — and state calls passed through."""
    from moetier.predict.grouped import GroupedPredictor, for_model
    from moetier.predict.hot import HotPredictor

    inner = HotPredictor([0, 1], 4, 2, {0: np.array([1, 2, 3, 4]), 1: np.array([4, 3, 2, 1])})
    grouped = for_model(inner, [[0, 0, 2, 2], [1, 1, 1, 3]])
    assert isinstance(grouped, GroupedPredictor) and for_model(grouped, ()) is inner and for_model(inner, ()) is inner
    (layer, scores), = grouped.predict(0, np.zeros((3, 8))).items()
    assert layer == 1 and scores.shape == (3, 4)
    np.testing.assert_allclose(scores[0], [0.0, 0.9, 0.0, 0.1], rtol=1e-6)
    with pytest.raises(ValueError, match="one group list"):
        GroupedPredictor(inner, [[0, 0, 2, 2]])
