"""A layer's query, key and value projections as one matrix (`qkv_proj`: their rows one after another), so a decode
step makes one product of the three, as vLLM's QKVParallelLinear and nano-vllm do.

Why: each product is a call — the Python around it, a native call, the activation quantized again in the
quantized modes, a parallel region and its barriers — and at batch 1 the three small products of a layer cost
about as much around them as in them (OLMoE-1B-7B: 2048 x 2048 each, ~100 us of kernel apiece at int4). One
product computes each output row exactly as before (a row's dot product does not depend on the others), so exact
mode is unchanged.

The stacking is decided before the dense weights are placed (`Stacked`, nothing copied yet): moved into huge pages
the parts are copied into one place there (moetier/engine/huge_pages.py); elsewhere they are concatenated one layer
at a time (`materialized`), so the peak holds at most one layer's copy beside its parts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from moetier.model.dense_quant import QuantizedMatrix

PARTS = ("q_proj", "k_proj", "v_proj")
STACKED = "qkv_proj"


@dataclass(frozen=True)
class Stacked:
    """Matrices of one kind and input width, to be one [sum of rows, K] matrix (tensors of one dtype and device,
    or QuantizedMatrix of one precision and group), or vectors (biases) to be one."""

    parts: tuple

    def __post_init__(self) -> None:
        if not stackable(self.parts):
            raise ValueError("parts of different kinds, dtypes or input widths do not stack")

    def pieces(self) -> list[list[torch.Tensor]]:
        """The tensors to stack, by role: [[parts]] for tensors; [[codes], [scales], [zeros]] for quantized ones
        (no zeros for int8)."""
        first = self.parts[0]
        if isinstance(first, torch.Tensor):
            return [list(self.parts)]
        roles = [[p.q.codes for p in self.parts], [p.q.scales for p in self.parts]]
        return roles + ([[p.q.zeros for p in self.parts]] if first.q.zeros is not None else [])

    def build(self, stack: Callable[[list[torch.Tensor]], torch.Tensor] = torch.cat):
        """The one matrix, each role's pieces made one tensor by `stack` (rows one after another)."""
        first = self.parts[0]
        made = [stack(role) for role in self.pieces()]
        if isinstance(first, torch.Tensor):
            return made[0]
        q = replace(first.q, codes=made[0], scales=made[1], zeros=made[2] if len(made) > 2 else None)
        return QuantizedMatrix(q, (sum(p.shape[0] for p in self.parts), first.shape[1]), first.group)


def stackable(parts) -> bool:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return all(isinstance(p, torch.Tensor) and p.dtype == first.dtype and p.device == first.device
                   and p.shape[1:] == first.shape[1:] for p in parts)
    return all(isinstance(p, QuantizedMatrix) and p.q.precision == first.q.precision and p.group == first.group
               and p.shape[1] == first.shape[1] for p in parts)


def stack_qkv(dense: dict, num_layers: int) -> dict:
    """`dense` with each layer's q/k/v projections (and their biases, where all three have one) as one `Stacked`
    `layers.i.qkv_proj` (and `.bias`). A layer whose three differ in kind or width, or have some biases but not
    all, or one named twice, or that has no such projections (latent attention), is left as it is."""
    out = dict(dense)
    named = Counter(id(v) for v in dense.values())  # (a part also named elsewhere is left alone: copied once)
    for i in range(num_layers):
        names = [f"layers.{i}.{n}" for n in PARTS]
        if (not all(n in dense for n in names) or not stackable([dense[n] for n in names])
                or any(named[id(dense[n])] > 1 for n in names)):
            continue
        biases = [dense.get(f"{n}.bias") for n in names]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            continue
        for n in names:
            del out[n]
        out[f"layers.{i}.{STACKED}"] = Stacked(tuple(dense[n] for n in names))
        if biases[0] is not None:
            for n in names:
                del out[f"{n}.bias"]
            out[f"layers.{i}.{STACKED}.bias"] = Stacked(tuple(biases))
    return out


def materialized(dense: dict) -> dict:
    """Each `Stacked` concatenated, one at a time, its parts let go as it is made (the rest as they are)."""
    out = {}
    for name in list(dense):
        value = dense.pop(name)
        out[name] = value.build() if isinstance(value, Stacked) else value
    return out
