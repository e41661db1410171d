"""A step's RMSNorms (each with the residual add before it) and rotary embeddings on a GPU, one Triton launch
each, for bf16 models, and its keys and values written into the cache in one (`TritonKernels` in
moetier/model/kernels.py; imported only where triton is installed: it is the GPU machine's, not a dependency).

Why: through torch's ops an RMSNorm is eight launches (the cast up, the square, the mean, + eps, rsqrt, the product,
the cast down, the weight) and a rotation seven (two gathers of the tables, two products, the negation, the cat, the
sum); an OLMoE layer has four norms (its q and k norms besides the two of every layer) and two rotations: 46 of the
~110 launches a decode layer made on the H200 (a step ~1,700; bench/gpu/results/2026-11-27-h200/profile-olmoe.json),
each 10–24 us of the host's time there. Each residual add goes into the norm after it, and a layer's two KV writes
(an index_put_ each) into one launch.

The same values as torch's ops (the reference's, transformers'): each kernel rounds to bf16 where those ops round —
round to nearest even, written out on the bits (`round_bf16`) so that the interpreter, which truncates in its casts,
rounds as the GPU does. A rotation is bit for bit torch's (the products of two bf16 values are exact in fp32, so
rounding each once is what torch's bf16 multiply does; so the sum, and a residual add). A norm's mean of squares is
summed in another order than torch's reduction: its fp32 sum may differ in the last bits, and a result by one bf16
step where that tips a rounding (rarely; the tests bound how often)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetier.model.rope import RopeTables


@triton.jit
def round_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), as fp32: what a cast to bf16 gives on a GPU."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def normed(h, weight, cols, inside, H, eps, FP32_WEIGHT: tl.constexpr):
    """RMSNorm of a row h [BH] (fp32) times the bf16 weight, rounded to bf16: transformers' (the normed row rounded
    before the weight, the product again) or with FP32_WEIGHT gpt-oss's (the weight applied in fp32, one rounding)."""
    variance = tl.sum(h * h, axis=0) / H
    n = h * tl.math.rsqrt(variance + eps)
    if not FP32_WEIGHT:
        n = round_bf16(n)
    w = tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)
    return round_bf16(w * n)


@triton.jit
def rms_norm_kernel(x, weight, out, stride_x, H, eps, BH: tl.constexpr, FP32_WEIGHT: tl.constexpr = False):
    """Row `program_id` of x [R, H] (rows stride_x apart) -> out [R, H]: the RMSNorm `normed` computes."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BH)
    inside = cols < H
    h = tl.load(x + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)  # [BH]
    tl.store(out + row * H + cols, normed(h, weight, cols, inside, H, eps, FP32_WEIGHT).to(tl.bfloat16), mask=inside)


@triton.jit
def add_rms_norm_kernel(h, delta, weight, summed, out, H, eps, BH: tl.constexpr, FP32_WEIGHT: tl.constexpr = False):
    """Row `program_id` of the residual stream h [R, H] plus delta [R, H] -> summed (rounded to bf16, as torch's add)
    and its RMSNorm -> out, as `rms_norm_kernel` computes it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BH)
    inside = cols < H
    at = row * H + cols
    s = round_bf16(tl.load(h + at, mask=inside, other=0.0).to(tl.float32)
                   + tl.load(delta + at, mask=inside, other=0.0).to(tl.float32))  # [BH]
    tl.store(summed + at, s.to(tl.bfloat16), mask=inside)
    tl.store(out + at, normed(s, weight, cols, inside, H, eps, FP32_WEIGHT).to(tl.bfloat16), mask=inside)


@triton.jit
def rope_kernel(x, positions, cos, sin, out, heads, D, dim, BHALF: tl.constexpr, BTAIL: tl.constexpr,
                INTERLEAVED: tl.constexpr):
    """Head `program_id` of x [N, heads, D] rotated to its token's position: the first `dim` dimensions in halves
    (out = x·cos + rotate_half(x)·sin, each product and the sum rounded to bf16 as torch's ops round), or with
    INTERLEAVED in pairs (x0, x1), (x2, x3)... written out in halves (DeepSeek's, as transformers lays it out); the
    rest copied. cos, sin: [S, dim] bf16 tables."""
    pid = tl.program_id(0).to(tl.int64)
    position = tl.load(positions + pid // heads).to(tl.int64)
    half = dim // 2
    j = tl.arange(0, BHALF)
    inside = j < half
    src, dst = x + pid * D, out + pid * D
    table = position * dim
    c1 = tl.load(cos + table + j, mask=inside, other=0.0).to(tl.float32)
    s1 = tl.load(sin + table + j, mask=inside, other=0.0).to(tl.float32)
    if INTERLEAVED:  # (pairs, each with its frequency's cos and sin from the first half of the tables)
        x1 = tl.load(src + 2 * j, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(src + 2 * j + 1, mask=inside, other=0.0).to(tl.float32)
        c2, s2 = c1, s1
    else:
        x1 = tl.load(src + j, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + j, mask=inside, other=0.0).to(tl.float32)
        c2 = tl.load(cos + table + half + j, mask=inside, other=0.0).to(tl.float32)
        s2 = tl.load(sin + table + half + j, mask=inside, other=0.0).to(tl.float32)
    first = round_bf16(round_bf16(x1 * c1) + round_bf16(-x2 * s1))
    second = round_bf16(round_bf16(x2 * c2) + round_bf16(x1 * s2))
    tl.store(dst + j, first.to(tl.bfloat16), mask=inside)
    tl.store(dst + half + j, second.to(tl.bfloat16), mask=inside)
    if BTAIL > 0:  # (a partial rotation: the dimensions past `dim` as they are)
        t = dim + tl.arange(0, BTAIL)
        rest = t < D
        tl.store(dst + t, tl.load(src + t, mask=rest, other=0.0), mask=rest)


@triton.jit
def kv_write_kernel(k, v, keys, values, rows, positions, heads, max_len, D, BD: tl.constexpr):
    """Head `program_id` of a step's keys and values k, v [N, heads, D] into the layer's caches [R, heads, max_len,
    D] at its token's row and position: both in one launch (torch's index_put_ is one each)."""
    pid = tl.program_id(0).to(tl.int64)
    n, h = pid // heads, pid % heads
    row, position = tl.load(rows + n).to(tl.int64), tl.load(positions + n).to(tl.int64)
    d = tl.arange(0, BD)
    inside = d < D
    place = ((row * heads + h) * max_len + position) * D
    tl.store(keys + place + d, tl.load(k + pid * D + d, mask=inside), mask=inside)
    tl.store(values + place + d, tl.load(v + pid * D + d, mask=inside), mask=inside)


def takes_norm_of(x: torch.Tensor) -> bool:
    """Whether `rms_norm` takes x as it lies: contiguous, or rows of contiguous values (MLA's latent, a slice of a
    wider product's columns)."""
    return x.is_contiguous() or (x.dim() == 2 and x.stride(1) == 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fp32_weight: bool = False) -> torch.Tensor:
    """Over the last dimension of bf16 x (any leading shape; `takes_norm_of`), weight [H] bf16 (`fp32_weight`:
    applied in fp32, gpt-oss's)."""
    h = x.shape[-1]
    rows = x.view(-1, h) if x.is_contiguous() else x  # [R, H]
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), h, eps, BH=triton.next_power_of_2(h),
                                          FP32_WEIGHT=fp32_weight, num_warps=_warps(h))
    return out.view(x.shape)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 fp32_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, its RMSNorm) for contiguous bf16 h, delta [R, H] alike; new tensors (h is left as it was: what
    a look-ahead holds of it)."""
    rows, width = h.shape
    summed, out = torch.empty_like(h), torch.empty_like(h)
    if rows:
        add_rms_norm_kernel[(rows,)](h, delta, weight, summed, out, width, eps, BH=triton.next_power_of_2(width),
                                     FP32_WEIGHT=fp32_weight, num_warps=_warps(width))
    return summed, out


def rope(tables: RopeTables, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] contiguous bf16 rotated to positions [N] (in halves, or in pairs where the tables say)."""
    n, heads, d = x.shape
    dim = tables.dim
    out = torch.empty_like(x)
    if n:
        rope_kernel[(n * heads,)](x, positions, tables.cos, tables.sin, out, heads, d, dim,
                                  BHALF=triton.next_power_of_2(dim // 2),
                                  BTAIL=0 if dim == d else triton.next_power_of_2(d - dim),
                                  INTERLEAVED=tables.interleaved)
    return out


def takes_kv_write(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `kv_write` takes them: each a contiguous tensor, the step's k and v [N, heads, D] shaped alike and
    typed as the caches [R, heads, max_len, D] (a latent cache's writes are MLA's own)."""
    return (k.shape == v.shape and keys.shape == values.shape and k.shape[1:] == keys.shape[1:2] + keys.shape[3:]
            and k.dtype == v.dtype == keys.dtype == values.dtype
            and all(t.is_contiguous() for t in (k, v, keys, values)))


def kv_write(keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k, v [N, heads, D] into keys, values [R, heads, max_len, D] at (rows[i], positions[i]) (`takes_kv_write`)."""
    n, heads, d = k.shape
    if n:
        kv_write_kernel[(n * heads,)](k, v, keys, values, rows, positions, heads, keys.shape[2], d,
                                      BD=triton.next_power_of_2(d))


def _warps(h: int) -> int:
    """Warps for a row of h values: enough that each thread holds a few (a 7,168-wide DeepSeek-V3 row: 8)."""
    return max(1, min(8, triton.next_power_of_2(h) // 512))
