"""A matrix in one of GGML's block formats times some tokens, through the native library's integer kernels
(`csrc/q_ggml.c`: the activation quantized to Q8_K or Q8_0 blocks, llama.cpp's arithmetic; 4 tokens a pass, each row
read once for all of them), or the matrix dequantized once (moetier/quant/ggml_blocks.py) for torch's GEMM: for a bf16
model's tokens, the integer kernels up to gemm_precision.integer_tokens (a few dozen where the CPU has bf16 dot
products, below which dequantizing the matrix costs more than the integer product; any number where it has not,
torch's bf16 GEMM running there at a quarter of these kernels' speed), and an fp32 model's beyond a pass (the parity
tests' arithmetic).

`GgmlLinear(lib)(x, w, fmt)`: x [T, K] (any float dtype), w uint8 [N, K/block·type_size] -> fp32 [T, N]."""

from __future__ import annotations

import ctypes

import torch

from moetier.model.gemm_precision import bf16_gemm_is_fast, integer_tokens
from moetier.quant.ggml_blocks import FORMATS, dequantize

TYPE_IDS = {"q8_0": 0, "q4_k": 1, "q5_k": 2, "q6_k": 3, "q4_0": 4, "q4_1": 5, "q5_0": 6, "q5_1": 7,
            "mxfp4": 8}  # GQ_*
MAX_TOKENS = 4  # GQ_MAX_TOKENS
GGML_BITS = -1  # how the C side marks GGML blocks: moetier_matrix.bits (decode_block.c), a TokenTable's bits
# (decode_step.c, token_routed.c: [E, 4] addresses and types)
GGML_CLAMPED_BITS = -2  # a TokenTable of gpt-oss's experts in GGML blocks: [E, 6], their biases' addresses after
# (token_routed.c moetier_gq_glu_token_routed; never a one-call step's: resident_step.py takes SwiGLU alone)


class GgmlLinear:
    def __init__(self, lib: ctypes.CDLL, bf16_gemm: bool | None = None) -> None:
        self.lib = lib
        self.bf16_gemm = bf16_gemm_is_fast() if bf16_gemm is None else bf16_gemm
        # the most of a bf16 model's tokens a matrix in each format computes through the kernels (gemm_precision)
        self.limits = {fmt: max(MAX_TOKENS, integer_tokens(fmt, self.bf16_gemm)) for fmt in FORMATS}
        self.scratch = torch.empty(0, dtype=torch.uint8)  # the quantized activations, grown once to the largest
        self.dense = torch.empty(0, dtype=torch.float32)  # a prefill's dequantized matrix, grown once likewise
        self.fits: dict[tuple[str, int], bool] = {}

    def takes(self, fmt: str, k: int) -> bool:
        """Whether the integer kernels compute format `fmt` over `k` inputs (asked once per shape)."""
        key = (fmt, k)
        if key not in self.fits:
            self.fits[key] = fmt in TYPE_IDS and bool(self.lib.moetier_gq_fits(TYPE_IDS[fmt], k))
        return self.fits[key]

    def passes(self, x: torch.Tensor, fmt: str) -> bool:
        """Whether x's tokens go through the integer kernels, not a dequantized matrix's GEMM: a pass's worth, and a
        bf16 model's up to where the GEMM pays (gemm_precision.integer_tokens: any number where it is slow)."""
        return x.shape[0] <= (self.limits[fmt] if x.dtype == torch.bfloat16 else MAX_TOKENS)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, fmt: str) -> torch.Tensor:
        t, k = x.shape
        n = w.shape[0]
        w = w.reshape(n, -1)  # (a legacy format's [N, blocks, block bytes] view: its rows)
        if w.dtype != torch.uint8 or w.shape[1] != FORMATS[fmt].row_bytes(k):
            raise ValueError(f"{fmt} weights for {k} inputs are uint8 [N, {FORMATS[fmt].row_bytes(k)}], got "
                             f"{w.dtype} {tuple(w.shape)}")
        if not self.passes(x, fmt) or not self.takes(fmt, k):  # (a prefill: a bf16 model's through torch's bf16 GEMM)
            if x.dtype == torch.bfloat16 and fmt in TYPE_IDS:
                return (x @ self.dequantize(w, fmt, k, torch.bfloat16).T).float()
            return x.float() @ self.dequantize(w, fmt, k).T
        kind = TYPE_IDS[fmt]
        xf = x.float().contiguous()
        need = t * self.lib.moetier_gq_act_bytes(kind, k)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need, dtype=torch.uint8)
        act = self.scratch
        self.lib.moetier_gq_quantize_act(kind, xf.data_ptr(), k, t, act.data_ptr())
        w = w.contiguous()
        if t > MAX_TOKENS:  # every row once for all the passes: its outputs together, [N, T]
            yt = torch.empty(n, t, dtype=torch.float32)
            self.lib.moetier_gq_linear_tokens(kind, w.data_ptr(), n, k, act.data_ptr(), t, yt.data_ptr())
            return yt.T
        y = torch.empty(t, n, dtype=torch.float32)
        self.lib.moetier_gq_linear(kind, w.data_ptr(), n, k, act.data_ptr(), t, y.data_ptr())
        return y

    def dequantize(self, w: torch.Tensor, fmt: str, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """w's values [N, k] (a prefill's GEMM), fp32 or rounded to bf16: natively, bit for bit ggml_blocks.
        dequantize (and its bf16 rounding), in a buffer reused across calls (valid until the next)."""
        if fmt not in TYPE_IDS:
            return dequantize(w, fmt).to(dtype)
        n = w.shape[0]
        w = w.reshape(n, -1)
        if self.dense.numel() * 4 < n * k * dtype.itemsize:
            self.dense = torch.empty(n * k, dtype=torch.float32)
        out = self.dense.view(torch.uint8)[:n * k * dtype.itemsize].view(dtype).view(n, k)
        call = self.lib.moetier_gq_dequantize if dtype == torch.float32 else self.lib.moetier_gq_dequantize_bf16
        call(TYPE_IDS[fmt], w.contiguous().data_ptr(), n, k, out.data_ptr())
        return out

    def fuses(self, x: torch.Tensor, gu_fmt: str, d_fmt: str, i: int) -> bool:
        """Whether `swiglu` computes this expert: bf16 rows, both matrices' tokens through the kernels (`passes`),
        both formats in them."""
        return (x.dtype == torch.bfloat16 and self.passes(x, gu_fmt) and self.passes(x, d_fmt)
                and self.takes(gu_fmt, x.shape[1]) and self.takes(d_fmt, i))

    def swiglu(self, out: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, gu_fmt: str, down: torch.Tensor,
               d_fmt: str, weights: torch.Tensor) -> None:
        """out [T, H] bf16 = a SwiGLU expert on x [T, H] bf16 scaled by weights [T], in one native call
        (csrc/q_ggml.c moetier_gq_swiglu: what GgmlExpert's torch ops compute, without their per-op costs; more
        tokens than a pass, each row read once for all of them)."""
        t, h = x.shape
        i = gate_up.shape[0] // 2
        gu, d = TYPE_IDS[gu_fmt], TYPE_IDS[d_fmt]
        need = self.lib.moetier_gq_swiglu_scratch(gu, d, h, i, t)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need, dtype=torch.uint8)
        w = weights.to(torch.bfloat16).contiguous()
        self.lib.moetier_gq_swiglu(gu, gate_up.data_ptr(), d, down.data_ptr(), h, i, x.contiguous().data_ptr(), t,
                                   w.data_ptr(), out.data_ptr(), self.scratch.data_ptr())
