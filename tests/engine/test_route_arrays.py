"""The routing on the host (moetier/engine/route_arrays.py): the CPU's own memory, or one copy back from a GPU."""

import numpy as np
import pytest
import torch

from moetier.engine.route_arrays import route_arrays


def routing(device: str, weight_dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    scores = torch.softmax(torch.randn(3, 64, generator=g), -1)  # [T, E]
    topk_weights, topk_ids = scores.topk(4, dim=-1)
    return topk_ids.to(device), topk_weights.to(weight_dtype).to(device), scores.to(device)


def test_on_the_cpu_the_arrays_are_the_tensors_own_memory():
    ids, weights, scores = routing("cpu", torch.float32)
    a, b, c = route_arrays(ids, weights, scores)
    assert np.shares_memory(a, ids.numpy()) and np.shares_memory(b, weights.numpy())
    assert np.shares_memory(c, scores.numpy())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu/run.sh)")
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_from_a_gpu_one_copy_gives_what_three_give(weight_dtype):
    ids, weights, scores = routing("cuda", weight_dtype)
    a, b, c = route_arrays(ids, weights, scores)
    assert a.dtype == np.int64 and np.array_equal(a, ids.cpu().numpy())
    assert np.array_equal(b, weights.float().cpu().numpy()) and np.array_equal(c, scores.cpu().numpy())
    assert all(x.flags.c_contiguous for x in (a, b, c))
