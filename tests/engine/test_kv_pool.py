"""KV rows handed out lowest first and taken back once; a request's parameters refused when they cannot run."""

import pytest
import torch

from moetier.engine.kv_pool import KVPool, kv_bytes_per_token
from moetier.engine.request import RequestParams
from moetier.errors import MoetierError
from moetier.model_info import inspect_model


def test_rows_lowest_first_and_given_back_once(tiny_store):
    _, path = tiny_store("olmoe")
    spec = inspect_model(path).spec
    pool = KVPool(spec, 3, 8, torch.float32)
    assert [pool.take(), pool.take()] == [0, 1] and pool.free == 1
    pool.give(0)
    assert pool.take() == 0  # the lowest free row again
    with pytest.raises(ValueError, match="not in use"):
        pool.give(2)  # never taken
    with pytest.raises(ValueError, match="not in use"):
        pool.give(7)  # not a row
    with pytest.raises(ValueError):
        KVPool(spec, 0, 8, torch.float32)
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4  # keys and values, fp32
    assert kv_bytes_per_token(spec, torch.float32) == per_token == pool.cache.nbytes // (3 * 8)


def test_request_parameters_that_cannot_run_are_refused():
    with pytest.raises(MoetierError, match="stop string"):
        RequestParams(stop=("",))
    with pytest.raises(MoetierError, match="logprobs"):
        RequestParams(logprobs=21)
    assert RequestParams(stop=("\n",), logprobs=0).logprobs == 0
