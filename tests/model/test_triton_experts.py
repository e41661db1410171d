"""The Triton kernels of quantized experts (moetier/model/triton_experts.py): on a GPU where there is one; else,
where triton is installed, in its interpreter on the CPU (which rounds to bf16 by truncation, not to nearest: the
checks say which they hold to). Skipped where triton is not installed (CI: it is the GPU machine's, not a
dependency)."""

import importlib.util
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton is first imported)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the GPU machine's)")
DEVICE = "cuda" if CUDA else "cpu"

from moetier.model.expert_kernels import QuantizedExpert, make_expert_kernel  # noqa: E402
from moetier.model.kernels import CudaKernels, TorchKernels  # noqa: E402
from moetier.quant.codes import BITS, Quantized, dequantize, quantize_expert  # noqa: E402

if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    from moetier.model.triton_kernels import weights_block

    @triton.jit
    def dump(codes, scales, zeros, out, stride_c, stride_s, K, BITS: tl.constexpr, GROUP: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr):
        """Every weight `weights_block` hands the products, written out."""
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            tl.store(out + rows[:, None] * K + k[None, :],
                     weights_block(codes, scales, zeros, rows, k, stride_c, stride_s, BITS, GROUP))


def expert(h: int = 256, i: int = 128, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"gate_up_proj": torch.randn(2 * i, h, generator=g) * 0.05, "down_proj": torch.randn(h, i, generator=g) * 0.05}


def on(w: dict) -> dict:
    return {k: t.to(DEVICE) for k, t in w.items()}


def truncated(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by truncation (the interpreter's conversion), as fp32."""
    return (t.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)


@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
def test_the_kernels_weights_are_the_codes_dequantized(precision):
    """Every weight the kernel multiplies, written out: `dequantize`'s, rounded to bf16 as the device rounds."""
    q = quantize_expert(expert(), precision)
    codes, scales = q["gate_up_proj"], q["gate_up_proj.scales"]
    zeros = q.get("gate_up_proj.zeros", scales)
    n, k = codes.shape[0], 256
    out = torch.empty(n, k, device=DEVICE)
    group = k if scales.dim() == 1 else k // scales.shape[1]
    dump[(n // 32,)](*(t.to(DEVICE) for t in (codes, scales, zeros)), out, codes.stride(0),
                     scales.stride(0), k, BITS=BITS[precision], GROUP=group, BN=32, BK=64)
    exact = dequantize(Quantized(precision, codes, scales, q.get("gate_up_proj.zeros")), torch.float32)
    want = exact.bfloat16().float() if CUDA else truncated(exact)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_an_expert_from_its_codes_computes_what_the_dequantizing_path_does(precision, tokens):
    from moetier.model.triton_experts import TritonQuantizedExpert

    q = on(quantize_expert(expert(), precision))
    reference = QuantizedExpert(precision, TorchKernels(), torch.bfloat16)
    kernel = TritonQuantizedExpert(BITS[precision], reference)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 256, generator=g).bfloat16().to(DEVICE)
    weights = torch.rand(tokens, generator=g).bfloat16().to(DEVICE)
    want, got = torch.empty_like(x), torch.full_like(x, float("nan"))
    reference(want, x, q, weights)
    kernel(got, x, q, weights)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < (1e-2 if CUDA else 5e-2), err  # (the interpreter truncates at every bf16 rounding)


def test_a_gpu_computes_quantized_experts_with_it_and_a_prefill_through_the_dequantizing_path():
    from moetier.model.triton_experts import MAX_TOKENS, TritonQuantizedExpert

    kernel = make_expert_kernel("int4", CudaKernels(), torch.bfloat16)
    assert isinstance(kernel, TritonQuantizedExpert)
    assert isinstance(make_expert_kernel("int4", TorchKernels(), torch.bfloat16), QuantizedExpert)
    q = on(quantize_expert(expert(), "int4"))
    x = torch.randn(MAX_TOKENS + 3, 256).bfloat16().to(DEVICE)
    weights = torch.ones(MAX_TOKENS + 3, dtype=torch.bfloat16, device=DEVICE)
    got, want = torch.empty_like(x), torch.empty_like(x)
    kernel(got, x, q, weights)
    kernel.fallback(want, x, q, weights)
    assert torch.equal(got, want)  # (more tokens than the kernel's tile: the dequantizing path itself)
