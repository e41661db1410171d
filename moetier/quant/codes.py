"""Weight-only quantized copies of matrices (an expert's, and dense ones), as a store holds them and the kernels
read them: plain integer codes and their scales, in a layout that does not depend on the torch version or the CPU
(a kernel's own packing is made at load, or a native kernel reads these directly).

- int8: symmetric, one scale per output channel: w ≈ q · s, q in [-127, 127].
- int4: asymmetric, one (scale, zero) pair per group of 128 inputs: w ≈ (q − 8) · s + z, q in [0, 15], two codes
  a byte (even input column in the low nibble). `zero` is the value code 8 stands for, as torch's CPU int4
  matmul (`_weight_int4pack_mm_for_cpu`) takes it.
- int2: asymmetric as int4, q in [0, 3], four codes a byte (column 4j in the lowest two bits), groups of 64 inputs
  (HOBBIT pairs int2 with int8 and names no group size: ours; a bfloat16 scale and zero per 64 weights add half a
  bit per weight).

Scales and zeros are bfloat16 (the engine's compute dtype). Every function takes and returns CPU tensors; a
matrix is [N, K] = [out_features, in_features], as `gate_up_proj` and `down_proj` are stored. An expert's
biases (gpt-oss) are kept, in bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.quant.formats import BITS, GROUP_SIZE  # noqa: F401  (their sizes, kept where torch is not)

MATRICES = ("gate_up_proj", "down_proj")  # a SwiGLU expert's, each [N, K]


def swiglu_shapes(hidden: int, intermediate: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """A SwiGLU expert's tensors (what ModelSpec.expert_shapes gives for most families)."""
    return (("gate_up_proj", (2 * intermediate, hidden)), ("down_proj", (hidden, intermediate)))


def group_size(precision: str, k: int) -> int:
    """Inputs per (scale, zero) of a grouped precision over `k` inputs: its group, or the whole row when the row is
    shorter (a demo model's 64-wide down_proj)."""
    group = GROUP_SIZE[precision]
    if k <= group:
        return k
    if k % group:
        raise ValueError(f"{precision} needs in_features divisible by {group} (or at most {group}), got {k}")
    return group


def quantized_nbytes(precision: str, n: int, k: int) -> int:
    """Bytes of an [N, K] matrix's `precision` copy: its codes, scales and zeros (as `quantize` makes them)."""
    if precision == "int8":
        return n * k + 2 * n
    groups = k // group_size(precision, k)
    return n * k * BITS[precision] // 8 + 2 * 2 * n * groups


def quantize_expert(tensors: dict[str, torch.Tensor], precision: str) -> dict[str, torch.Tensor]:
    """An expert's float tensors -> the named tensors of its `precision` blob (as `expert_layout` lays them)."""
    out = {}
    for name, t in tensors.items():
        if t.dim() == 1:  # a bias
            out[name] = t.to(torch.bfloat16)
            continue
        q = quantize(t, precision)
        out[name], out[f"{name}.scales"] = q.codes, q.scales
        if q.zeros is not None:
            out[f"{name}.zeros"] = q.zeros
    return out


def matrix_names(w: dict[str, torch.Tensor]) -> list[str]:
    """The quantized matrices among a blob's tensors: those with scales."""
    return [name.removesuffix(".scales") for name in w if name.endswith(".scales")]


def expert_matrices(w: dict[str, torch.Tensor], precision: str) -> dict[str, Quantized]:
    """The named tensors of a `precision` blob (views, as a slot holds them) -> its quantized matrices."""
    return {name: Quantized(precision, w[name], w[f"{name}.scales"], w.get(f"{name}.zeros")) for name in matrix_names(w)}


@dataclass(frozen=True)
class Quantized:
    """One matrix's codes and scales. `codes`: int8 [N, K] for int8; uint8 [N, K·bits/8] packed otherwise.
    `scales`: [N] for int8; [N, K/group] otherwise. `zeros`: [N, K/group] (None for int8)."""

    precision: str
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.precision not in BITS:
            raise ValueError(f"unknown quantized precision {self.precision!r}; known: {', '.join(BITS)}")


ROWS_AT_ONCE = 1 << 22  # weights quantized at once: the fp32 temporaries of a 50k x 2k head would be ~2 GB


def quantize(w: torch.Tensor, precision: str) -> Quantized:
    """[N, K] float weights -> their `precision` copy (rows taken a few million weights at a time: each row's codes
    depend on that row alone, and the fp32 temporaries stay small)."""
    if w.dim() != 2:
        raise ValueError(f"expected a matrix [N, K], got shape {tuple(w.shape)}")
    if precision not in BITS:
        raise ValueError(f"unknown quantized precision {precision!r}; known: {', '.join(BITS)}")
    if precision != "int8" and w.shape[1] % (8 // BITS[precision]):
        raise ValueError(f"{precision} packs {8 // BITS[precision]} inputs a byte; in_features {w.shape[1]} is not "
                         f"a multiple")
    n, step = w.shape[0], max(1, ROWS_AT_ONCE // max(1, w.shape[1]))
    first = _quantize_rows(w[:step].float(), precision)
    if step >= n:
        return first
    # each part written into its place as it is made (parts then a concatenation held the copy twice)
    out = [None if t is None else t.new_empty((n, *t.shape[1:])) for t in (first.codes, first.scales, first.zeros)]
    for i in range(0, n, step):
        part = first if i == 0 else _quantize_rows(w[i:i + step].float(), precision)
        for whole, piece in zip(out, (part.codes, part.scales, part.zeros)):
            if whole is not None:
                whole[i:i + step] = piece
    return Quantized(precision, *out)


def _quantize_rows(w: torch.Tensor, precision: str) -> Quantized:
    if precision == "int8":
        return _int8(w)
    return _grouped(w, precision, group_size(precision, w.shape[1]))


def dequantize(q: Quantized, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weights a quantized copy stands for, [N, K] in `dtype` (the reference every kernel is checked against)."""
    if q.precision == "int8":
        return (q.codes.float() * q.scales.float()[:, None]).to(dtype)
    bits = BITS[q.precision]
    codes = unpack(q.codes, bits).float()  # [N, K]
    n, k = codes.shape
    group = k // q.scales.shape[1]
    mid = 2 ** (bits - 1)
    w = (codes.view(n, k // group, group) - mid) * q.scales.float()[..., None] + q.zeros.float()[..., None]
    return w.view(n, k).to(dtype)


def _int8(w: torch.Tensor) -> Quantized:
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [N]
    scale = scale.to(torch.bfloat16)  # rounded first, so the codes are taken against the scale that is stored
    codes = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return Quantized("int8", codes, scale)


def _grouped(w: torch.Tensor, precision: str, group: int) -> Quantized:
    bits = BITS[precision]
    levels, mid = 2 ** bits - 1, 2 ** (bits - 1)
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # [N, K/group]
    scale = ((hi - lo) / levels).clamp(min=torch.finfo(torch.float32).tiny).to(torch.bfloat16)
    zero = (lo + mid * scale.float()).to(torch.bfloat16)  # the value of the middle code
    codes = torch.round((g - zero.float()[..., None]) / scale.float()[..., None] + mid).clamp(0, levels)
    return Quantized(precision, pack(codes.view(n, k).to(torch.uint8), bits), scale, zero)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [N, K] of `bits` bits -> [N, K·bits/8], column j·(8/bits)+i in bits i·bits.. of byte j."""
    per = 8 // bits
    n, k = codes.shape
    c = codes.reshape(n, k // per, per).to(torch.int32)
    out = torch.zeros(n, k // per, dtype=torch.int32)
    for i in range(per):
        out |= c[..., i] << (i * bits)
    return out.to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack`: [N, K·bits/8] -> uint8 codes [N, K]."""
    per, mask = 8 // bits, (1 << bits) - 1
    p = packed.to(torch.int32)
    return torch.stack([(p >> (i * bits)) & mask for i in range(per)], dim=-1).view(packed.shape[0], -1) \
        .to(torch.uint8)
