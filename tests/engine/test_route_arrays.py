"""The routing on the host (moetier/engine/route_arrays.py): the CPU's own memory, or one copy back from a GPU."""

import numpy as np
import pytest
import torch

from moetier.engine.route_arrays import pack, route_arrays, route_arrays_with, routes_arrays, unpack, unpack_with


def routing(device: str, weight_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.softmax(torch.randn(3, 64, generator=g), -1)  # [T, E]
    topk_weights, topk_ids = scores.topk(4, dim=-1)
    return topk_ids.to(device), topk_weights.to(weight_dtype).to(device), scores.to(device)


def test_on_the_cpu_the_arrays_are_the_tensors_own_memory():
    ids, weights, scores = routing("cpu", torch.float32)
    a, b, c = route_arrays(ids, weights, scores)
    assert np.shares_memory(a, ids.numpy()) and np.shares_memory(b, weights.numpy())
    assert np.shares_memory(c, scores.numpy())


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layers", [1, 3])
def test_packed_into_one_array_each_route_reads_back_as_itself(weight_dtype, layers):
    """What goes back from a GPU in one copy (here packed and unpacked on the CPU): each layer's ids, weights and
    scores exactly, each contiguous."""
    routes = [routing("cpu", weight_dtype, seed) for seed in range(layers)]
    packed = pack(routes)
    assert packed.shape == (layers, 3, 2 * 4 + 64) and packed.dtype == torch.float32
    for (ids, weights, scores), (a, b, c) in zip(routes, unpack(packed.numpy(), 4), strict=True):
        assert a.dtype == np.int64 and np.array_equal(a, ids.numpy())
        assert np.array_equal(b, weights.float().numpy()) and np.array_equal(c, scores.numpy())
        assert all(x.flags.c_contiguous for x in (a, b, c))


def test_on_the_cpu_several_routes_are_each_ones_own_memory():
    routes = [routing("cpu", torch.float32, seed) for seed in range(3)]
    for (ids, weights, scores), (a, b, c) in zip(routes, routes_arrays(routes), strict=True):
        assert np.shares_memory(a, ids.numpy()) and np.shares_memory(b, weights.numpy())
        assert np.shares_memory(c, scores.numpy())
    assert routes_arrays([]) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu/run.sh)")
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_from_a_gpu_a_steps_routes_in_one_copy_are_what_each_layers_gives(weight_dtype):
    routes = [routing("cuda", weight_dtype, seed) for seed in range(4)]
    for one, (a, b, c) in zip(routes, routes_arrays(routes), strict=True):
        want = route_arrays(*one)
        assert np.array_equal(a, want[0]) and np.array_equal(b, want[1]) and np.array_equal(c, want[2])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu/run.sh)")
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_from_a_gpu_one_copy_gives_what_three_give(weight_dtype):
    ids, weights, scores = routing("cuda", weight_dtype)
    a, b, c = route_arrays(ids, weights, scores)
    assert a.dtype == np.int64 and np.array_equal(a, ids.cpu().numpy())
    assert np.array_equal(b, weights.float().cpu().numpy()) and np.array_equal(c, scores.cpu().numpy())
    assert all(x.flags.c_contiguous for x in (a, b, c))


def test_a_predictors_scores_go_back_in_the_routings_copy():
    """The stacked gates' probabilities for the coming layers, packed after the routing (one copy, one wait a
    layer where reading them after it was a second): unpacked, the routing and they are each exactly themselves."""
    ids, weights, scores = routing("cpu", torch.bfloat16)
    probs = torch.softmax(torch.randn(3, 2 * 64, generator=torch.Generator().manual_seed(1)), -1)  # [T, p·E]
    packed = pack([(ids, weights, scores)], probs[None])
    assert packed.shape == (1, 3, 2 * 4 + 64 + 128)
    (a, b, c), extra = unpack_with(packed[0].numpy(), 4, 64)
    assert np.array_equal(a, ids.numpy()) and np.array_equal(b, weights.float().numpy())
    assert np.array_equal(c, scores.numpy()) and np.array_equal(extra, probs.numpy()) and extra.flags.c_contiguous
    assert unpack_with(pack([(ids, weights, scores)])[0].numpy(), 4, 64)[1] is None
    (a, b, c), extra = route_arrays_with(ids, weights, scores, probs)  # (on the CPU: the tensors' own values)
    assert np.array_equal(extra, probs.numpy()) and np.array_equal(a, ids.numpy())
