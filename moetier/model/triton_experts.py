"""Quantized SwiGLU experts on a GPU, computed from their codes by two Triton kernels — gate and up together with
the SiLU and the product, then down with the routing weight — instead of torch's ops dequantizing each matrix
(unpack, subtract, scale, shift, cast: ~20 launches an expert, 656 us for an int4 OLMoE expert on the H200 against
86 us in bf16; bench/gpu/micro.py). Each program dequantizes a block of rows in registers, bf16 as the reference
rounds them (moetier/quant/codes.py `dequantize`), and multiplies them into fp32 sums with `tl.dot`, the tokens
padded to 16 rows; more tokens than `MAX_TOKENS` (a prefill) go to the dequantizing path.

Codes as the store holds them: int8 symmetric per row (w = q·s); int4 and int2 grouped, asymmetric around the
middle code (w = (q − mid)·s + z per group of 128 or 64 inputs), two or four codes a byte, the lowest bits first."""

from __future__ import annotations

import torch

MAX_TOKENS = 16  # rows of the tl.dot tile; a longer prompt's experts are dequantized once instead
BLOCK_N = 16  # output rows a program computes (16: tl.dot's least; more programs for a GPU's 132 SMs)
BLOCK_K = 64  # inputs a step reads (a divisor of every group: 64 and 128)


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernels():
    """The two kernels (moetier/model/triton_kernels.py, which imports triton: only where a GPU run asks for them)."""
    from moetier.model.triton_kernels import down, gate_up

    return gate_up, down


class TritonQuantizedExpert:
    """`kernel(out, x, w, weights)` for an int8/int4/int2 SwiGLU expert on a GPU (moetier.model.expert_kernels'
    interface); `fallback` (the dequantizing kernel) takes what this one does not: more than MAX_TOKENS tokens,
    shapes its blocks do not tile."""

    def __init__(self, bits: int, fallback) -> None:
        self.bits, self.fallback = bits, fallback
        self._made = None
        self._h = torch.empty(0)  # [T, I] bf16 between the two kernels, grown to the largest seen

    def _fits(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> bool:
        h, i = x.shape[1], w["gate_up_proj"].shape[0] // 2
        return (x.shape[0] <= MAX_TOKENS and h % BLOCK_K == 0 and i % BLOCK_K == 0 and h % BLOCK_N == 0
                and i % BLOCK_N == 0 and x.dtype == torch.bfloat16)

    def __call__(self, out: torch.Tensor, x: torch.Tensor, w: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
        if not self._fits(x, w):
            return self.fallback(out, x, w, weights)
        if self._made is None:
            self._made = _kernels()
        gate_up, down = self._made
        t, h = x.shape
        gu, dn = w["gate_up_proj"], w["down_proj"]
        i = gu.shape[0] // 2
        gu_s, dn_s = w["gate_up_proj.scales"], w["down_proj.scales"]
        gu_z, dn_z = w.get("gate_up_proj.zeros", gu_s), w.get("down_proj.zeros", dn_s)  # (int8: no zeros, unread)
        if self._h.numel() < t * i or self._h.device != x.device:
            self._h = torch.empty(MAX_TOKENS * i, dtype=torch.bfloat16, device=x.device)
        hid = self._h[:t * i].view(t, i)
        x = x.contiguous()
        stride_s = lambda s: s.stride(0)  # noqa: E731 (int8's one scale a row: stride 1)
        gate_up[(i // BLOCK_N,)](x, gu, gu_s, gu_z, hid, t, h, i, x.stride(0), gu.stride(0), stride_s(gu_s),
                                 hid.stride(0), BITS=self.bits, GROUP=_group(h, gu_s), BT=MAX_TOKENS, BN=BLOCK_N,
                                 BK=BLOCK_K)
        down[(h // BLOCK_N,)](hid, dn, dn_s, dn_z, weights, out, t, i, hid.stride(0), dn.stride(0), stride_s(dn_s),
                              out.stride(0), BITS=self.bits, GROUP=_group(i, dn_s), BT=MAX_TOKENS, BN=BLOCK_N,
                              BK=BLOCK_K)

    def layer(self, ys, xs, weights, items) -> None:
        for w, a, b in items:
            self(ys[a:b], xs[a:b], w, weights[a:b])

    def token(self, out, x, weights, ws, combine) -> None:
        self.fallback.token(out, x, weights, ws, combine)

    def token_table(self, ws):
        return None


def _group(k: int, scales: torch.Tensor) -> int:
    """Inputs per scale (a whole row for int8's one scale a row)."""
    return k if scales.dim() == 1 else k // scales.shape[1]
