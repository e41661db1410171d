"""SwiGLU experts whose matrices are in GGML's block formats (a store's q8_0/q6_k/q5_k/q4_k copies, and a GGUF's
experts read in place): gate and up, then down, each through `GgmlLinear` — the native integer kernels for up to
four tokens, the matrix dequantized for torch's matmul beyond, or always without the native library. Which format
each matrix is in follows from the precision and its width (moetier/quant/precisions.py: matrix_format)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetier.model.expert_kernels import OneByOne
from moetier.model.ggml_linear import GgmlLinear
from moetier.quant.ggml_blocks import dequantize
from moetier.quant.precisions import BLOCKS, matrix_format


class TorchGgml:
    """GgmlLinear's contract without the native library: dequantized, torch's matmul."""

    def __call__(self, x: torch.Tensor, w: torch.Tensor, fmt: str) -> torch.Tensor:
        return x.float() @ dequantize(w, fmt).T


class GgmlExpert(OneByOne):
    """`lib`: the native library (None: torch's ops). `dtype`: the activations', which the gate·up product and the
    output are rounded to, as a float expert's torch ops round them."""

    def __init__(self, precision: str, dtype: torch.dtype, lib=None) -> None:
        if precision not in BLOCKS:
            raise ValueError(f"not a GGML block precision: {precision!r}")
        self.precision, self.dtype = precision, dtype
        self.linear = GgmlLinear(lib) if lib is not None else TorchGgml()

    def __call__(self, out: torch.Tensor, x: torch.Tensor, w: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
        h, i = x.shape[1], w["gate_up_proj"].shape[0] // 2
        gate_up = self.linear(x, w["gate_up_proj"], matrix_format(self.precision, h)).to(self.dtype)  # [n, 2I]
        gate, up = gate_up[:, :i], gate_up[:, i:]
        act = F.silu(gate) * up  # [n, I]
        y = self.linear(act, w["down_proj"], matrix_format(self.precision, i))  # [n, H] fp32
        out.copy_(y.to(self.dtype) * weights[:, None].to(self.dtype))
