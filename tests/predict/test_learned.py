"""The trained predictors (llapor, comoe-mlp) on a hand-made task they can learn — the next layer's experts are a
fixed function of the hidden state — and their files beside a model."""

import numpy as np
import pytest
import torch

from moetier.errors import MoetierError
from moetier.plan.route import RouteResult
from moetier.predict import make_predictor
from moetier.predict.llapor import INPUT, MIDDLE, OUTPUT, layer_groups
from moetier.predict.quality import recall
from moetier.predictor_files import load_nets, predictor_file, save_nets, train_nets

E, K, H, LAYERS = 8, 2, 16, [0, 1, 2]


def task(n: int, seed: int):
    """gate inputs [N, L, H], topk_ids [N, L, k]: each layer's experts are the top-2 of a fixed projection of its
    hidden state, and the next layer's hidden state is this one's plus a little noise."""
    rng = np.random.default_rng(seed)
    proj = np.random.default_rng(99).standard_normal((H, E))
    h0 = rng.standard_normal((n, H))
    hidden = np.stack([h0 + 0.05 * i * rng.standard_normal((n, H)) for i in range(len(LAYERS))], 1)
    ids = np.argsort(-(hidden @ proj), axis=-1)[..., :K]
    weights = np.full(ids.shape, 0.5, np.float16)
    seq = np.repeat(np.arange(n // 16), 16)
    return hidden.astype(np.float16), ids.astype(np.int16), weights, seq


@pytest.mark.parametrize("name", ["llapor", "comoe-mlp"])
def test_a_trained_predictor_learns_the_next_layers_experts(name, tmp_path):
    gate, ids, weights, seq = task(1024, 0)
    nets = train_nets(name, gate, ids, weights, seq, LAYERS, E, epochs=25)
    assert sorted(nets) == [0, 1]  # one per layer but the last
    test_gate, test_ids, test_weights, _ = task(256, 1)
    p = make_predictor(name, LAYERS, E, K, nets=nets)
    got = []
    for t in range(256):
        route = RouteResult(0, t, test_ids[t:t + 1, 0].astype(np.int64), test_weights[t:t + 1, 0].astype(np.float32),
                            np.zeros((1, E), np.float32))
        p.observe(0, test_gate[t:t + 1, 0], route)
        scores = p.predict(0, test_gate[t:t + 1, 0])[1]
        got.append(recall(scores, test_ids[t:t + 1, 1].astype(np.int64)))
    assert np.mean(got) > 0.8  # chance is k/E = 0.25

    path = predictor_file(tmp_path, name)
    save_nets(name, path, nets, {"hidden": H, "num_experts": E, "layers": LAYERS})
    again = make_predictor(name, LAYERS, E, K, nets=load_nets(name, tmp_path))
    again.observe(0, test_gate[:1, 0], route)
    p.on_sequence_start()
    again.on_sequence_start()
    p.observe(0, test_gate[:1, 0], route)
    # the file holds float16 weights: the scores agree to their precision
    np.testing.assert_allclose(again.predict(0, test_gate[:1, 0])[1], p.predict(0, test_gate[:1, 0])[1], atol=2e-3)


def test_a_missing_or_damaged_predictor_file_says_how_to_make_it(tmp_path):
    with pytest.raises(MoetierError, match="no trained file.*does not exist") as e:
        load_nets("llapor", tmp_path)
    assert "moetier train predictor --predictor llapor" in e.value.hint
    path = predictor_file(tmp_path, "llapor")
    path.parent.mkdir()
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(MoetierError, match="not a trained predictor file"):
        load_nets("llapor", tmp_path)


def test_llapor_keeps_learning_online_from_what_the_next_layer_chose():
    gate, ids, weights, seq = task(256, 0)
    nets = train_nets("llapor", gate, ids, weights, seq, LAYERS, E, epochs=1)
    p = make_predictor("llapor", LAYERS, E, K, nets=nets, online_every=2)
    before = [t.clone() for t in nets[0].parameters()]
    for t in range(2):  # two decode tokens: layer 0 predicts, layer 1 routes and teaches it
        for j, layer in enumerate(LAYERS[:2]):
            route = RouteResult(layer, t, ids[t:t + 1, j].astype(np.int64), weights[t:t + 1, j].astype(np.float32),
                                np.zeros((1, E), np.float32))
            p.observe(layer, gate[t:t + 1, j], route)
            p.predict(layer, gate[t:t + 1, j])
    assert any(not torch.equal(a, b) for a, b in zip(before, nets[0].parameters()))


def test_layer_groups_are_the_first_and_last_quarter():
    groups = layer_groups(list(range(8)))
    assert [groups[i] for i in range(8)] == [INPUT, INPUT, MIDDLE, MIDDLE, MIDDLE, MIDDLE, OUTPUT, OUTPUT]
    assert layer_groups([3, 5]) == {3: INPUT, 5: OUTPUT}
