"""KV rows handed out lowest first and taken back once; a request's parameters refused when they cannot run."""

import pytest
import torch

from moetier.engine.kv_pool import KeptCache, KVPool, kv_bytes_per_token
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


def test_a_kept_cache_is_handed_again_where_it_fits_else_made_anew_a_step_longer(tiny_store):
    """KeptCache (`--cuda-graphs`: the graphs captured on a cache replay on it alone): the same cache for a call of
    the same rows and no longer; a new one, kept instead, for other rows or a longer call; its length rounded up to
    a multiple of `step`, at most the context window."""
    _, path = tiny_store("olmoe")
    spec = inspect_model(path).spec
    kept = KeptCache(spec, torch.float32, "cpu", step=16)
    first = kept(1, 10)
    assert (first.rows, first.max_len) == (1, 16)
    assert kept(1, 16) is first and kept(1, 3) is first
    longer = kept(1, 33)
    assert longer is not first and longer.max_len == 48 and kept(1, 5) is longer
    two = kept(2, 5)
    assert two.rows == 2 and kept(1, 5) is not longer  # (one kept at a time)
    ctx = spec.max_position_embeddings
    assert KeptCache(spec, torch.float32, "cpu", step=ctx - 1)(1, ctx).max_len == ctx  # (not 2·(ctx - 1))
    whole = kept(1, spec.max_position_embeddings - 1)
    assert whole.max_len == spec.max_position_embeddings and kept(1, 20) is whole
    kept.clear()
    assert kept.cache is None
    pool = KVPool(spec, 1, 20, torch.float32, cache=kept(1, 20))
    assert pool.cache is kept.cache and pool.max_len == 32 and pool.rows == 1  # (20 rounded up)
    with pytest.raises(ValueError, match="cannot hold 2 of 20"):
        KVPool(spec, 2, 20, torch.float32, cache=kept(1, 20))
    with pytest.raises(ValueError, match="cannot hold 1 of 40"):
        KVPool(spec, 1, 40, torch.float32, cache=kept(1, 20))


def test_request_parameters_that_cannot_run_are_refused():
    with pytest.raises(MoetierError, match="stop string"):
        RequestParams(stop=("",))
    with pytest.raises(MoetierError, match="logprobs"):
        RequestParams(logprobs=21)
    assert RequestParams(stop=("\n",), logprobs=0).logprobs == 0
