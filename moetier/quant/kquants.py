"""Float weights into GGML's block formats, fitted as ggml fits them with no importance matrix (what
`llama-quantize` does to a model without `--imatrix`): ggml's reference quantizers (`quantize_row_q8_0_ref`,
`quantize_row_q{4,5,6}_K_ref` in ggml-quants.c) written again over whole tensors of blocks at once —

- q8_0: a scale per 32 weights from their largest magnitude, codes rounded half away from zero;
- q4_k / q5_k: per 32 weights, the scale and minimum of a weighted least-squares fit (weights av|x| + |x|) over
  candidate inverse scales (make_qkx2_quants: 21 candidates for q4_k, 16 for q5_k), then the eight scales and
  minimums quantized to 6 bits under an fp16 super-scale and super-minimum, and the codes taken again against the
  scales as stored;
- q6_k: per 16 weights a symmetric scale by the x²-weighted fit over 19 candidates (make_qx_quants, rmse_type 1),
  the sixteen scales to int8 under an fp16 super-scale, the codes taken again.

Byte for byte what the C writes: a group's sums are taken one term after another in float32, as the C takes them
(`seq_sum`: torch's own order moved a sum's last bit, and where two candidate fits were that close, the other was
kept — 3% of q6_k's groups), the square root correctly rounded (torch's float32 sqrt is not), a maximum of zeros +0
as the C's. tests/quant/test_kquants.py checks the bytes against a line-by-line transliteration of the C; on
OLMoE-shaped weights they were also the bytes llama-quantize wrote (docs/mixed-precision.md). Returns the bytes
`ggml_blocks.dequantize` reads: uint8 [N, K/block_size·type_size] for an [N, K] matrix.
"""

from __future__ import annotations

import torch

from moetier.quant.ggml_blocks import FORMATS, MXFP4_VALUES

BLOCKS_AT_ONCE = 1 << 13  # super-blocks fitted at once: each candidate's temporaries are a few MB


def quantize(w: torch.Tensor, name: str) -> torch.Tensor:
    """[N, K] float weights -> uint8 [N, K/block_size·type_size] in format `name` (q8_0, q4_k, q5_k, q6_k,
    mxfp4)."""
    if name not in FIT:
        raise ValueError(f"cannot quantize to {name!r}; formats: {', '.join(FIT)}")
    if w.dim() != 2:
        raise ValueError(f"expected a matrix [N, K], got shape {tuple(w.shape)}")
    fmt = FORMATS[name]
    n, k = w.shape
    fmt.row_bytes(k)  # refuses a row that is not whole blocks
    blocks = w.reshape(-1, fmt.block_size)  # [B, block_size], each row's blocks in order
    out = torch.empty(blocks.shape[0], fmt.type_size, dtype=torch.uint8)
    for i in range(0, blocks.shape[0], BLOCKS_AT_ONCE):
        out[i:i + BLOCKS_AT_ONCE] = FIT[name](blocks[i:i + BLOCKS_AT_ONCE].float())
    return out.reshape(n, -1)


def nearest_int(x: torch.Tensor) -> torch.Tensor:
    """ggml's nearest_int: to the nearest integer, ties to even (its float trick), as int32."""
    return torch.round(x).to(torch.int32)


def round_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: to the nearest integer, ties away from zero (without the 0.49999997 + 0.5 = 1 slip)."""
    a = x.abs()
    f = a.floor()
    return torch.sign(x) * (f + torch.floor(2 * (a - f)))


def seq_sum(t: torch.Tensor) -> torch.Tensor:
    """[n, M] -> [M]: each column's n terms added one after another in float32, as ggml's loops add a group's
    terms (n = 16 or 32 additions over all M groups at once, each a contiguous row)."""
    total = t[0].clone()
    for i in range(1, t.shape[0]):
        total += t[i]
    return total


def f32(v: float) -> torch.Tensor:
    """A C float constant (`0.1f`), so arithmetic with it rounds as ggml's does."""
    return torch.tensor(v, dtype=torch.float32)


def fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 [B] -> its fp16 (rounded to nearest even, GGML_FP32_TO_FP16) as uint8 [B, 2], little-endian."""
    return v.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def fp16_value(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).float()


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(dim=1) / 127  # [B]
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    qs = round_away(x * inv[:, None]).to(torch.int8).view(torch.uint8)
    return torch.cat([fp16_bytes(d), qs], dim=1)


def make_qkx2_quants(x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float, rdelta: float,
                     nstep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group's (rows of x [M, n]) scale and minimum by weighted least squares over candidate inverse scales:
    returns (scale [M], the_min [M] (the minimum negated, ≥ 0), codes [M, n] in 0..nmax)."""
    x, weights = x.T.contiguous(), weights.T.contiguous()  # [n, M]: a group's terms one contiguous row apart
    lo = x.amin(dim=0).clamp(max=0)  # the minimum, never above 0
    hi = x.amax(dim=0)
    sum_w = seq_sum(weights)
    sum_x = seq_sum(weights * x)
    flat = hi == lo
    one = torch.ones_like(hi)
    span = torch.where(flat, one, hi - lo)
    iscale = nmax / span
    scale = 1 / iscale
    codes = nearest_int(iscale * (x - lo)).clamp(0, nmax)
    best = seq_sum(weights * (scale * codes + lo - x) ** 2)
    for step in range(nstep + 1):  # ggml moves the minimum as it goes, and the next candidates with it
        span = torch.where(flat, one, hi - lo)
        iscale = (f32(rmin) + f32(rdelta) * step + nmax) / span
        aux = nearest_int(iscale * (x - lo)).clamp(0, nmax)
        lf = aux.float()
        wl = weights * lf
        sum_l = seq_sum(wl)
        sum_l2 = seq_sum(wl * lf)
        sum_xl = seq_sum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = torch.where(ok, det, one)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = this_min > 0  # a minimum above 0: fit the scale alone, through 0
        this_scale = torch.where(positive, sum_xl / torch.where(sum_l2 > 0, sum_l2, one), this_scale)
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        err = seq_sum(weights * (this_scale * lf + this_min - x) ** 2)
        better = ok & (err < best) & ~flat
        codes = torch.where(better, aux, codes)
        best = torch.where(better, err, best)
        scale = torch.where(better, this_scale, scale)
        lo = torch.where(better, this_min, lo)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    codes = torch.where(flat, torch.zeros_like(codes), codes)
    return scale, -lo, codes.T


def _k_blocks(x: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int):
    """What q4_k and q5_k share: x [B, 256] -> (d, dmin as fp16 bytes [B, 2] each, the 12 scale bytes [B, 12],
    codes [B, 8, 32] in 0..nmax against the scales as stored)."""
    b = x.shape[0]
    sub = x.reshape(b * 8, 32)
    av = torch.sqrt((seq_sum((sub * sub).T) / 32).double()).float()  # torch's float32 sqrt is not correctly rounded
    scales, mins, codes = make_qkx2_quants(sub, av[:, None] + sub.abs(), nmax, rmin, rdelta, nstep)
    scales, mins, codes = scales.view(b, 8), mins.view(b, 8), codes.view(b, 8, 32)
    zero = torch.zeros(b)  # ggml starts both maxima at +0 and takes only a larger value (never a −0)
    max_scale = torch.where(scales.amax(dim=1) > 0, scales.amax(dim=1), zero)
    max_min = torch.where(mins.amax(dim=1) > 0, mins.amax(dim=1), zero)
    inv_scale = torch.where(max_scale > 0, 63 / torch.where(max_scale > 0, max_scale, 1), 0)
    inv_min = torch.where(max_min > 0, 63 / torch.where(max_min > 0, max_min, 1), 0)
    ls = (nearest_int(inv_scale[:, None] * scales) & 0xFF).clamp(max=63)  # C: a uint8, then MIN(63, ·)
    lm = (nearest_int(inv_min[:, None] * mins) & 0xFF).clamp(max=63)
    packed = torch.zeros(b, 12, dtype=torch.int32)
    packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    d, dmin = max_scale / 63, max_min / 63
    sd = fp16_value(d)[:, None] * ls.float()  # [B, 8]: each sub-block's scale as stored
    sm = fp16_value(dmin)[:, None] * lm.float()
    again = nearest_int((x.view(b, 8, 32) + sm[..., None]) / torch.where(sd != 0, sd, 1)[..., None]).clamp(0, nmax)
    codes = torch.where((sd != 0)[..., None], again, codes)  # ggml keeps the fitted codes where a scale is 0
    return fp16_bytes(d), fp16_bytes(dmin), packed.to(torch.uint8), codes


def _q4_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, scales, codes = _k_blocks(x, 15, -1.0, 0.1, 20)
    c = codes.view(-1, 4, 2, 32)  # chunks of 64: sub-block 2c in the low nibbles, 2c+1 in the high
    qs = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(-1, 128)
    return torch.cat([d, dmin, scales, qs.to(torch.uint8)], dim=1)


def _q5_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, scales, codes = _k_blocks(x, 31, -0.5, 0.1, 15)
    c = codes.view(-1, 4, 2, 32)
    qs = ((c[:, :, 0] & 0xF) | ((c[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    high = (codes >> 4).view(-1, 8, 32)  # sub-block j's fifth bits are bit j of qh
    qh = (high << torch.arange(8, dtype=torch.int32).view(1, 8, 1)).sum(dim=1)
    return torch.cat([d, dmin, scales, qh.to(torch.uint8), qs.to(torch.uint8)], dim=1)


def make_qx_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's (rows of x [M, n]) symmetric scale by the x²-weighted fit over 19 candidate inverse scales
    (rmse_type 1): returns (scale [M], codes [M, n] in 0..2·nmax−1, the signed code plus nmax)."""
    at = x.abs().argmax(dim=1, keepdim=True)  # the first of the largest magnitudes, as ggml's strict `>`
    big = x.gather(1, at).squeeze(1)
    x = x.T.contiguous()  # [n, M]: a group's terms one contiguous row apart
    zero = big.abs() < 1e-15  # GROUP_MAX_EPS
    big = torch.where(zero, torch.ones_like(big), big)
    w = x * x

    def fit(iscale):
        l = nearest_int(iscale * x).clamp(-nmax, nmax - 1)
        lf = l.float()
        return l, seq_sum(w * x * lf), seq_sum(w * lf * lf)  # the C's order of products: (w·x)·l, (w·l)·l

    codes, sumlx, suml2 = fit(-nmax / big)
    scale = torch.where(suml2 != 0, sumlx / torch.where(suml2 != 0, suml2, 1), 0)
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        aux, sumlx, suml2 = fit(-(nmax + f32(0.1) * step) / big)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        codes = torch.where(better, aux, codes)
        scale = torch.where(better, sumlx / torch.where(suml2 > 0, suml2, 1), scale)
        best = torch.where(better, scale * sumlx, best)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    codes = torch.where(zero, torch.full_like(codes, -nmax), codes)  # ggml: L = 0, the code of −nmax
    return scale, (codes + nmax).T


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    b = x.shape[0]
    scales, codes = make_qx_quants(x.reshape(b * 16, 16), 32)
    scales, codes = scales.view(b, 16), codes.view(b, 16, 16)
    at = scales.abs().argmax(dim=1, keepdim=True)  # the first of the largest magnitudes
    max_scale = scales.gather(1, at).squeeze(1)
    empty = max_scale.abs() < 1e-15
    iscale = -128 / torch.where(empty, torch.ones_like(max_scale), max_scale)
    d = 1 / iscale
    sc = nearest_int(iscale[:, None] * scales).clamp(max=127)  # [B, 16], C: MIN(127, ·) into an int8
    sd = fp16_value(d)[:, None] * sc.float()
    again = nearest_int(x.view(b, 16, 16) / torch.where(sd != 0, sd, 1)[..., None]).clamp(-32, 31) + 32
    codes = torch.where((sd != 0)[..., None], again, codes).view(b, 2, 4, 32)  # [B, half, quarter, 32]
    lo, hi = codes & 0xF, codes >> 4
    ql = torch.stack([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], dim=2).reshape(b, 128)
    qh = (hi << torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(1, 1, 4, 1)).sum(dim=2).reshape(b, 64)
    block = torch.cat([ql.to(torch.uint8), qh.to(torch.uint8), sc.to(torch.int8).view(torch.uint8),
                       fp16_bytes(d)], dim=1)
    return torch.where(empty[:, None], torch.zeros_like(block), block)  # ggml zeroes a block of zeros whole


def _mxfp4(x: torch.Tensor) -> torch.Tensor:
    """ggml's quantize_row_mxfp4_ref: the exponent e = floor(log2 max|x|) - 2 + 127 (so the largest magnitude is
    at most 6 of the block's scale 2^(e - 127), the values doubled: 12 · 2^(e - 128)), each weight the E2M1 code
    nearest it (the first of equals, as the C's strict <), weights 0-15 in the low nibbles. A weight that already
    lies on an MXFP4 grid (a gpt-oss checkpoint's, dequantized) comes back as the same value: its block's largest
    magnitude puts the new scale at most a factor 2^3 under its old one, where every smaller value it held is a
    code again — a copy of gpt-oss's experts made this way is its checkpoint's values exactly."""
    amax = x.abs().amax(dim=1)  # [B]
    # (np.log2 in float32 and the cast to uint8 as the gguf package's port: a max under 2^-125 wraps, as there)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, 0).to(torch.int64) & 0xFF
    d = torch.ldexp(torch.ones_like(amax), e - 128)  # 2^(e - 128): the doubled values' scale (exact, subnormal too)
    values = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    errs = (d[:, None, None] * values - x[:, :, None]).abs()  # [B, 32, 16]: float32, as the C's fabsf(kv·d - x)
    codes = errs.argmin(dim=2).to(torch.uint8)  # (the first of equal errors)
    qs = codes[:, :16] | (codes[:, 16:] << 4)
    return torch.cat([e.to(torch.uint8)[:, None], qs], dim=1)


FIT = {"q8_0": _q8_0, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k, "mxfp4": _mxfp4}
