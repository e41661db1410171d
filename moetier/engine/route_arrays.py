"""A layer's routing on the host, where plans are made: the router's topk_ids [T, k], topk_weights [T, k] and scores
[T, E] as numpy arrays.

On the CPU they are the tensors' own memory (no copy). On a GPU each `.cpu()` is a copy that waits for the device:
three a layer, forty-eight a step on OLMoE-1B-7B, each a round trip of ~10-20 us on the H200 machine even when the
device has nothing left to do. Here the three go back as one: packed into float32 columns on the device (the ids
exact: below 2^24), one copy, one wait."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def route_arrays(topk_ids: torch.Tensor, topk_weights: torch.Tensor, scores: torch.Tensor,
                 wait: Callable[[], None] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids [T, k] int64, weights [T, k] float32, scores [T, E] float32) on the host; on the CPU views of the
    tensors (a caller that keeps them past the router's next write copies them). `wait`: on a GPU, how the host
    waits for the copy back (queued behind the router on the current stream; a copy queue's `wait_current` lets
    held copies onto the link meanwhile); default a plain wait."""
    if not topk_ids.is_cuda:
        return topk_ids.numpy(), topk_weights.float().numpy(), scores.float().numpy()
    k = topk_ids.shape[1]
    packed = torch.cat([topk_ids.float(), topk_weights.float(), scores.float()], dim=1)  # [T, 2k + E]
    if wait is None:
        packed = packed.cpu().numpy()
    else:
        packed = packed.to("cpu", non_blocking=True)  # (into page-locked memory: the copy runs while `wait` does)
        wait()
        packed = packed.numpy()
    return (np.ascontiguousarray(packed[:, :k], dtype=np.int64), np.ascontiguousarray(packed[:, k:2 * k]),
            np.ascontiguousarray(packed[:, 2 * k:]))
