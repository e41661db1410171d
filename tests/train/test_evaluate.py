"""The routing statistics of the model cards: cross-layer prediction on routing whose answer is known, and the
recording hook on the real engine."""

import numpy as np

from moetier import Engine
from train.evaluate import next_layer_mi_bits, next_layer_prediction, record_routing, uniform_routing

E, K = 16, 2


def chained(tokens: int, seed: int) -> np.ndarray:
    """Layer 1 uses experts (e + 3) mod E for layer 0's experts e: fully predictable from layer 0. [T, 2, K]"""
    first = uniform_routing((tokens, 1, K), E, seed)[:, 0]
    return np.stack([first, (first + 3) % E], axis=1)


def test_a_determined_next_layer_is_predicted_and_carries_information():
    recall, popular = next_layer_prediction(chained(4000, 0), chained(1000, 1), E)
    assert recall[0] == 1.0
    assert popular[0] < 0.25  # uniform usage: the most used K experts hold about K/E of the routing
    mi = next_layer_mi_bits(chained(4000, 0), E)[0]
    # given a layer-0 expert x, a layer-1 expert of the same token is x + 3 half the time, else one of the other
    # 15: H(Y|X) = 1 + log2(15) / 2, so I = 4 - 2.95 = 1.05 bits
    assert abs(mi - 1.05) < 0.05


def test_independent_layers_predict_no_better_than_chance():
    a, b = uniform_routing((4000, 2, K), E, 0), uniform_routing((1000, 2, K), E, 1)
    recall, _ = next_layer_prediction(a, b, E)
    assert abs(recall[0] - K / E) < 0.04
    assert next_layer_mi_bits(a, E)[0] < 0.1  # finite-sample bias only


def test_record_routing_collects_every_layer_from_the_engine(tiny_store):
    _, store = tiny_store("olmoe", max_position_embeddings=512)  # room for one 257-token window
    data = np.random.default_rng(0).integers(3, 128, 600)
    with Engine.from_pretrained(store, expert_memory="100%", progress=False) as engine:
        ids = record_routing(engine, data, 512)
        assert engine.executor.layer_step.hooks == [engine.executor.counts]  # the hook is gone afterwards
    assert ids.shape == (256, 2, 2)  # one window of 256 prompt tokens (257 with its target) and ids.min() >= 0 and ids.max() < 8
