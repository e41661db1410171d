"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints hold their experts: each byte two E2M1 codes (the even
element in the low nibble), each block of 32 elements one power-of-two scale stored as a biased exponent (127 is
2^0). Dequantized once at conversion; the store holds the result (bf16, as transformers dequantizes it)."""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [N, G, 16] and scales uint8 [N, G] of one matrix -> [N, G·32] in `dtype`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"(blocks [N, G, 16], scales [N, G])")
    lut = torch.tensor(E2M1, dtype=dtype)
    blocks = blocks.to(torch.uint8)
    values = torch.empty(*blocks.shape[:-1], 32, dtype=dtype)  # [N, G, 32]
    values[..., 0::2] = lut[(blocks & 0x0F).int()]
    values[..., 1::2] = lut[(blocks >> 4).int()]
    values = torch.ldexp(values, (scales.to(torch.int32) - SCALE_BIAS)[..., None])
    return values.reshape(blocks.shape[0], -1).to(dtype)
