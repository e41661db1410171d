"""(token, expert) pairs of a plan's assignment grouped by expert: ascending expert ids, tokens ascending within
each, so every token accumulates its experts' outputs in the order the reference does (bit-for-bit in fp32).
Pairs assigned SKIP run nothing.

The grouping is index arithmetic on a few dozen integers, done in numpy on the host where the plan already is:
as torch ops on tensors it cost ~75 us a layer at batch 1, a dozen tiny ops each paying torch's dispatch."""

from __future__ import annotations

import numpy as np
import torch


class ExpertGroups:
    def __init__(self, x: torch.Tensor, assign_ids: np.ndarray, assign_weights: np.ndarray, counts: np.ndarray,
                 weight_dtype: torch.dtype, combine=None) -> None:
        """x [T, H]; assign_ids, assign_weights [T, k] (host); counts [E] pairs per expert (SKIP not counted);
        weight_dtype: the router's (the reference weighs each expert's output in it); `combine`: the kernels' (the
        reference's index_add_ by default)."""
        self.x = x
        self._combine = combine
        flat = assign_ids.reshape(-1)  # [T*k]
        order = np.argsort(flat, kind="stable")  # SKIP (-1) sorts first
        order = order[flat.size - int(counts.sum()):]  # [P] the pairs that run
        self.token_of, self.ws = to_device(x.device, torch.from_numpy(order // assign_ids.shape[1]),  # [P] each
                                           torch.from_numpy(assign_weights.reshape(-1)[order]).to(weight_dtype))
        self.xs = x.index_select(0, self.token_of)  # [P, H]
        self.ys = torch.empty_like(self.xs)
        self.offsets = [0, *np.cumsum(counts).tolist()]
        self._sent: tuple[torch.Tensor, torch.Tensor] | None = None  # xs, ws on the host (`send`)
        self._sent_done = None  # the event after those copies

    def compute(self, expert: int, kernel, w: dict[str, torch.Tensor]) -> None:
        """`kernel(out, x, w, weights)` (moetier.model.expert_kernels) on the expert's tokens, `w` its slot's
        tensors."""
        a, b = self.offsets[expert], self.offsets[expert + 1]
        kernel(self.ys[a:b], self.xs[a:b], w, self.ws[a:b])

    def compute_layer(self, experts: list[int], kernel, ws: list[dict[str, torch.Tensor]]) -> None:
        """`compute` for several experts at once (`kernel.layer`: one native call where the kernel has one)."""
        offsets = self.offsets
        kernel.layer(self.ys, self.xs, self.ws, [(w, offsets[e], offsets[e + 1]) for e, w in zip(experts, ws)])

    def send(self, device: torch.device) -> None:
        """Start copying the pairs' activations and weights to `device` (the host CPU beside a GPU), where
        `compute_layer_on` will compute some experts: queued before the layer's device work, so the host waits for
        these copies alone, not for the experts the device computes meanwhile (HOBBIT's ④). Nothing to do on the
        device the activations are on."""
        if device == self.xs.device:
            return
        self._sent = (self.xs.to(device, non_blocking=True), self.ws.to(device, non_blocking=True))
        self._sent_done = torch.cuda.Event()
        self._sent_done.record(torch.cuda.current_stream(self.xs.device))

    def compute_layer_on(self, experts: list[int], kernel, ws: list[dict[str, torch.Tensor]],
                         device: torch.device) -> None:
        """`compute_layer` on `device`, where `ws` live (the host tier), from what `send` copied there: one call for
        the experts (one parallel region), their outputs copied back (⑥). On the device the activations are on
        already, just `compute_layer`."""
        if device == self.xs.device:
            return self.compute_layer(experts, kernel, ws)
        self._sent_done.synchronize()
        xs, weights = self._sent
        ys = torch.empty(xs.shape, dtype=xs.dtype, pin_memory=True)  # (page-locked: the copies back are queued)
        spans = [(self.offsets[e], self.offsets[e + 1]) for e in experts]
        kernel.layer(ys, xs, weights, [(w, a, b) for w, (a, b) in zip(ws, spans)])
        for a, b in spans:
            self.ys[a:b].copy_(ys[a:b], non_blocking=True)

    def combine(self) -> torch.Tensor:
        """Sum each token's expert outputs: [T, H]."""
        if self._combine is not None:
            return self._combine(self.x, self.token_of, self.ys)
        return torch.zeros_like(self.x).index_add_(0, self.token_of, self.ys)


def to_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host tensors (1-D, contiguous) on `device`: themselves on the CPU; to a GPU in one copy from one page-locked
    buffer, queued and not waited for (a copy from pageable memory makes the host wait for everything the device has
    queued), each a view of its bytes there. One copy, where a tensor each was a page-locked allocation and a copy
    (the callers cast the routing weights on the host first: no launch of their own on the device)."""
    if device.type == "cpu":
        return tensors
    staged, spans = packed(tensors, pin=True)
    return unpacked(staged.to(device, non_blocking=True), tensors, spans)


def packed(tensors, pin: bool) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """`tensors`' bytes in one uint8 buffer (page-locked: `pin`), and each one's (start, end) there: starts at
    multiples of 8 bytes, so of any element size."""
    spans, end = [], 0
    for t in tensors:
        start = -(-end // 8) * 8
        end = start + t.numel() * t.element_size()
        spans.append((start, end))
    staged = torch.empty(end, dtype=torch.uint8, pin_memory=pin)
    for t, (a, b) in zip(tensors, spans):
        staged[a:b].view(t.dtype).copy_(t)
    return staged, spans


def unpacked(staged: torch.Tensor, tensors, spans: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """`packed`'s buffer (wherever it was copied) as views of the tensors it holds."""
    return tuple(staged[a:b].view(t.dtype) for t, (a, b) in zip(tensors, spans))
