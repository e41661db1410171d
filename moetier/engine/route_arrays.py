"""A layer's routing on the host, where plans are made: the router's topk_ids [T, k], topk_weights [T, k] and scores
[T, E] as numpy arrays.

On the CPU they are the tensors' own memory (no copy). On a GPU each `.cpu()` is a copy that waits for the device:
three a layer, forty-eight a step on OLMoE-1B-7B, each a round trip of ~10-20 us on the H200 machine even when the
device has nothing left to do. Here the three go back as one: packed into float32 columns on the device (the ids
exact: below 2^24), one copy, one wait — and a resident step's layers, read after its last one, all in one
(`routes_arrays`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

Route = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (topk_ids [T, k], topk_weights [T, k], scores [T, E])
Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # the same on the host: int64, float32, float32


def route_arrays(topk_ids: torch.Tensor, topk_weights: torch.Tensor, scores: torch.Tensor,
                 wait: Callable[[], None] | None = None) -> Arrays:
    """(ids [T, k] int64, weights [T, k] float32, scores [T, E] float32) on the host; on the CPU views of the
    tensors (a caller that keeps them past the router's next write copies them). `wait`: on a GPU, how the host
    waits for the copy back (queued behind the router on the current stream; a copy queue's `wait_current` lets
    held copies onto the link meanwhile); default a plain wait."""
    return route_arrays_with(topk_ids, topk_weights, scores, None, wait)[0]


def route_arrays_with(topk_ids: torch.Tensor, topk_weights: torch.Tensor, scores: torch.Tensor,
                      extra: torch.Tensor | None, wait: Callable[[], None] | None = None,
                      ) -> tuple[Arrays, np.ndarray | None]:
    """`route_arrays`, and `extra` [T, n] (on the routing's device) read back in the same copy: a predictor's
    scores, which would otherwise be a second wait in the layer. On the CPU `extra`'s own memory as float32."""
    if not topk_ids.is_cuda:
        host = None if extra is None else extra.float().numpy()
        return (topk_ids.numpy(), topk_weights.float().numpy(), scores.float().numpy()), host
    packed = pack([(topk_ids, topk_weights, scores)], None if extra is None else extra[None])
    if wait is None:
        packed = packed.cpu().numpy()
    else:
        packed = packed.to("cpu", non_blocking=True)  # (into page-locked memory: the copy runs while `wait` does)
        wait()
        packed = packed.numpy()
    return unpack_with(packed[0], topk_ids.shape[1], scores.shape[1])


def routes_arrays(routes: list[Route]) -> list[Arrays]:
    """Several layers' (topk_ids, topk_weights, scores), each as `route_arrays` gives it: a resident step's, read
    once its last layer is queued. On a GPU one copy back and one wait for them all, where each layer's own was a
    wait and four or five launches (sixteen of each a step on OLMoE-1B-7B); on the CPU each one's views."""
    if not routes or not routes[0][0].is_cuda or len({tuple(t.shape for t in r) for r in routes}) > 1:
        return [route_arrays(*r) for r in routes]
    return unpack(pack(routes).cpu().numpy(), routes[0][0].shape[1])


def pack(routes: list[Route], extra: torch.Tensor | None = None) -> torch.Tensor:
    """[L, T, 2k + E (+ n)] float32 on the routes' device: each one's ids (exact: below 2^24), weights and scores
    side by side (and `extra` [L, T, n] after them): three stacks (none for one route), a cast for each part not
    float32 yet, one cat."""
    if len(routes) == 1:
        ids, weights, scores = (t[None] for t in routes[0])  # [1, T, k], [1, T, k], [1, T, E]
    else:
        ids, weights, scores = (torch.stack(parts) for parts in zip(*routes))  # [L, T, k], [L, T, k], [L, T, E]
    parts = [ids.float(), weights.float(), scores.float()]
    return torch.cat(parts if extra is None else [*parts, extra.float()], dim=2)


def unpack(packed: np.ndarray, k: int) -> list[Arrays]:
    """`pack`'s [L, T, 2k + E] on the host -> L (ids int64, weights, scores), each contiguous."""
    return [(np.ascontiguousarray(p[:, :k], dtype=np.int64), np.ascontiguousarray(p[:, k:2 * k]),
             np.ascontiguousarray(p[:, 2 * k:])) for p in packed]


def unpack_with(packed: np.ndarray, k: int, num_experts: int) -> tuple[Arrays, np.ndarray | None]:
    """One route's [T, 2k + E + n] -> (its arrays, as `unpack` gives them, and the n extra columns or None)."""
    width = 2 * k + num_experts
    extra = np.ascontiguousarray(packed[:, width:]) if packed.shape[1] > width else None
    return unpack(packed[None, :, :width], k)[0], extra
