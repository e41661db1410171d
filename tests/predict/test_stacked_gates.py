"""stacked-gates: one product of the current router input with the next layers' routers."""

import numpy as np
import pytest
import torch

from moetier.errors import MoetierError
from moetier.predict import make_predictor


def routers(layers=(0, 1, 2, 3), experts=6, hidden=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {layer: torch.randn(experts, hidden, generator=g) for layer in layers}


def test_scores_are_each_future_routers_softmax_on_the_current_input():
    w = routers()
    p = make_predictor("stacked-gates", (0, 1, 2, 3), 6, 2, distance=2, routers=w)
    x = torch.randn(3, 8)
    got = p.predict(1, x)
    assert sorted(got) == [2, 3]
    for f in (2, 3):
        assert got[f].shape == (3, 6)
        np.testing.assert_allclose(got[f], torch.softmax(x @ w[f].T, -1).numpy(), rtol=1e-5, atol=1e-6)
    assert sorted(p.predict(2, x)) == [3] and p.predict(3, x) == {}  # the end of the model
    assert p.predict(0, None) == {}  # nothing to predict from


def test_a_traces_float16_gate_inputs_are_accepted():
    w = routers()
    p = make_predictor("stacked-gates", (0, 1, 2, 3), 6, 2, routers=w)
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float16)
    np.testing.assert_allclose(p.predict(0, x)[1], torch.softmax(torch.from_numpy(x).float() @ w[1].T, -1).numpy(),
                               rtol=1e-4, atol=1e-5)


def test_what_a_predictor_is_built_on_must_be_given():
    with pytest.raises(MoetierError, match="needs routers"):
        make_predictor("stacked-gates", (0, 1), 6, 2)
    with pytest.raises(MoetierError, match="unknown predictor 'nope'"):
        make_predictor("nope", (0, 1), 6, 2)
    with pytest.raises(ValueError, match="no router weights for layers \\[1\\]"):
        make_predictor("stacked-gates", (0, 1), 6, 2, routers={0: torch.zeros(6, 8)})


def test_scores_read_back_with_the_routing_are_what_it_would_compute():
    """On a GPU the probabilities are queued beside the router (`on_device`) and come back in the routing's copy
    (`read_back`); `predict` then names what it would have computed itself — for that layer only, once. On the
    CPU there is nothing to queue: reading is free."""
    w = routers()
    p = make_predictor("stacked-gates", (0, 1, 2, 3), 6, 2, distance=2, routers=w)
    x = torch.randn(3, 8)
    assert p.on_device(1, x) is None  # (CPU routers)
    want = p.predict(1, x)
    values = p._probs(p.stacked[1], x).numpy()  # [T, p·E], what a GPU's on_device leaves
    p.read_back(1, values * 0 + 0.5)  # (a marker: predict must use what was read back)
    assert all(np.all(v == 0.5) for v in p.predict(1, x).values())
    p.read_back(1, values)
    got = p.predict(1, x)
    assert sorted(got) == sorted(want) and all(np.array_equal(got[f], want[f]) for f in want)
    p.read_back(0, values * 0 + 0.5)  # another layer's: not taken for layer 1
    assert all(np.array_equal(p.predict(1, x)[f], want[f]) for f in want)
