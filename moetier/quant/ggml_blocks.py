"""GGML's block formats, the ones GGUF files of MoE models carry (Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, and the legacy
Q4_0, Q4_1, Q5_0, Q5_1 that k-quant files fall back to): their sizes (formats.py, which loads no torch), and
the weights a run of blocks stands for, in torch (the reference every kernel is checked against, and the GPU's and
any other path's way to them). The layouts are ggml's (`ggml-common.h`); these functions are checked bit for bit
against the `gguf` package's numpy dequantizers (tests/quant/test_ggml_blocks.py), which stay the way to every
other type (`dequantize_other`).

A matrix [N, K] in a block format is N rows of K/block_size blocks, each row's blocks one after another, as GGUF
stores a tensor whose first dimension (ggml's ne[0]) is K. Every function takes uint8 bytes [..., blocks·type_size]
and returns float32 [..., blocks·block_size].
"""

from __future__ import annotations

import torch

from moetier.quant.formats import FORMATS, QK_K, BlockFormat  # noqa: F401  (their sizes, kept where torch is not)

# MXFP4's E2M1 values doubled (ggml's kvalues_mxfp4), the exponent then halved: exact in float32
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def dequantize(data: torch.Tensor, name: str) -> torch.Tensor:
    """uint8 [..., B·type_size] of format `name` -> float32 [..., B·block_size]."""
    fmt = FORMATS[name]
    if data.dtype != torch.uint8 or data.shape[-1] % fmt.type_size:
        raise ValueError(f"{name}: expected uint8 bytes in whole blocks of {fmt.type_size}, got {data.dtype} "
                         f"{tuple(data.shape)}")
    lead = data.shape[:-1]
    blocks = data.reshape(-1, fmt.type_size)  # [B, type_size]
    out = DEQUANTIZE[name](blocks)  # [B, block_size]
    return out.reshape(*lead, -1)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes a block, little-endian fp16 -> float32 [B, 1]."""
    return b.contiguous().view(torch.float16).float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of a q4_k/q5_k block's 12 bytes (ggml's get_scale_min_k4), [B, 8] each."""
    q = scales.to(torch.int32)
    d, m, md = q[:, 0:4], q[:, 4:8], q[:, 8:12]
    sc = torch.cat([d & 63, (md & 0xF) | ((d >> 6) << 4)], dim=1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], dim=1)
    return sc, mn


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A q4_k/q5_k block's per-32 scale and offset, float32 [B, 8, 1]: w = d·sc·q − dmin·m."""
    sc, mn = scale_min_k4(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * sc.float()).unsqueeze(-1)
    dm = (_f16(b[:, 2:4]) * mn.float()).unsqueeze(-1)
    return d, dm


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[B, 128] bytes -> [B, 8, 32]: each 32 bytes' low nibbles are one sub-block, their high nibbles the next."""
    q = qs.reshape(-1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).view(1, 1, 2, 1)
    return (q & 0xF).reshape(-1, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = _k_scales(b)
    return (d * _nibbles(b[:, 16:144]).float() - dm).reshape(-1, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = _k_scales(b)
    bit = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> bit  # sub-block j's bit j
    q = _nibbles(b[:, 48:176]) | ((qh & 1) << 4)
    return (d * q.float() - dm).reshape(-1, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql, qh = b[:, 0:128], b[:, 128:192]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # [B, 16], one per 16 weights
    d = (_f16(b[:, 208:210]) * scales).unsqueeze(-1)  # [B, 16, 1]
    lo = ql.reshape(-1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8, device=b.device).view(1, 1, 2, 1)
    lo = (lo & 0xF).reshape(-1, 8, 32)  # per half: ql[0:32] low, ql[32:64] low, ql[0:32] high, ql[32:64] high
    hi = qh.reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    hi = (hi & 3).reshape(-1, 8, 32)
    q = (lo | (hi << 4)).to(torch.int8) - 32
    return (d * q.reshape(-1, 16, 16).float()).reshape(-1, QK_K)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    e = b[:, :1].to(torch.int32)
    # 2^(e-128) (the values table is doubled); e = 0 is 2^-128, a subnormal float32 that ldexp gives exactly
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 128)
    values = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=b.device)  # (a GPU's blocks: looked up there)
    qs = b[:, 1:17].to(torch.int64)
    q = torch.cat([values[qs & 0xF], values[qs >> 4]], dim=1)  # low nibbles: the first 16 weights
    return scale * q


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """[B, 16] bytes -> [B, 32] int32: the low nibbles (weights 0-15), then the high (16-31)."""
    q = qs.to(torch.int32)
    return torch.cat([q & 0xF, q >> 4], dim=1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """[B, 4] bytes (a little-endian uint32) -> [B, 32] int32: bit j is weight j's fifth bit, as 16 or 0."""
    bits = qh.to(torch.int32).repeat_interleave(8, dim=1) >> torch.arange(8, device=qh.device).repeat(4)
    return (bits & 1) << 4


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_nibbles32(b[:, 2:18]) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _nibbles32(b[:, 4:20]).float() + _f16(b[:, 2:4])


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * ((_nibbles32(b[:, 6:22]) | _fifth_bits(b[:, 2:6])) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_nibbles32(b[:, 8:24]) | _fifth_bits(b[:, 4:8])).float() + _f16(b[:, 2:4])


DEQUANTIZE = {"q8_0": _q8_0, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k, "mxfp4": _mxfp4, "q4_0": _q4_0,
              "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1}
