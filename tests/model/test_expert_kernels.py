"""Quantized experts computed from their codes (native and torch paths) against the dequantized reference."""

import pytest
import torch

from moetier.model import native
from moetier.model.expert_kernels import DenseExpert, QuantizedExpert, make_expert_kernel
from moetier.model.kernels import TorchKernels
from moetier.store.quantize import MATRICES, Quantized, dequantize, expert_matrices, quantize_expert

LIB = native.load().lib
needs_native = pytest.mark.skipif(LIB is None, reason="no native kernels on this machine")


def expert(h, i, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"gate_up_proj": (torch.randn(2 * i, h, generator=g) / h ** 0.5).bfloat16(),
            "down_proj": (torch.randn(h, i, generator=g) / i ** 0.5).bfloat16()}


def reference(x, q: dict[str, Quantized], weights):
    """The expert with its dequantized bf16 weights, through torch's ops."""
    out = torch.empty_like(x)
    TorchKernels().expert(out, x, dequantize(q["gate_up_proj"]), dequantize(q["down_proj"]), weights)
    return out


@needs_native
@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
@pytest.mark.parametrize("h, i", [(256, 128), (64, 48), (512, 1024)])
@pytest.mark.parametrize("tokens", [1, 3, 4, 9])
def test_native_expert_matches_the_dequantized_reference(precision, h, i, tokens):
    w = quantize_expert(expert(h, i), precision)
    x = torch.randn(tokens, h).bfloat16()
    weights = torch.rand(tokens).bfloat16()
    kernel = QuantizedExpert(precision, TorchKernels(), torch.bfloat16, LIB)
    out = torch.full_like(x, float("nan"))
    kernel(out, x, w, weights)
    ref = reference(x, expert_matrices(w, precision), weights)
    # the weights are exact in the kernel and bf16-rounded in the reference: agreement to bf16's precision
    torch.testing.assert_close(out.float(), ref.float(), atol=0.02 * ref.float().abs().max().item(), rtol=0.03)
    assert (out.float() - ref.float()).abs().mean() < 0.01 * ref.float().abs().mean() + 1e-6


@needs_native
@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
def test_native_dequantization_is_the_reference_bit_for_bit(precision):
    w = quantize_expert(expert(256, 384, seed=1), precision)
    kernel = QuantizedExpert(precision, TorchKernels(), torch.bfloat16, LIB)
    q = expert_matrices(w, precision)
    for name in MATRICES:
        assert torch.equal(kernel._dequantized(name, w), dequantize(q[name]))


@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
def test_without_the_native_library_the_torch_path_is_the_reference(precision):
    w = quantize_expert(expert(64, 48), precision)
    x = torch.randn(2, 64)
    weights = torch.rand(2)
    out = torch.empty_like(x)
    QuantizedExpert(precision, TorchKernels(), torch.float32, LIB)(out, x, w, weights)  # fp32: never native
    q = expert_matrices(w, precision)
    ref = torch.empty_like(x)
    TorchKernels().expert(ref, x, dequantize(q["gate_up_proj"], torch.float32),
                          dequantize(q["down_proj"], torch.float32), weights)
    assert torch.equal(out, ref)


def test_a_float_precision_gets_the_dense_kernel():
    assert isinstance(make_expert_kernel("bf16", TorchKernels(), torch.bfloat16), DenseExpert)
    assert isinstance(make_expert_kernel("int4", TorchKernels(), torch.bfloat16), QuantizedExpert)


@pytest.mark.parametrize("family", ["gpt_oss", "switch_transformers"])
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_other_activations_compute_their_quantized_copy_as_its_dequantized_weights(tiny_store, family, precision):
    """gpt-oss's clamped SwiGLU with biases and Switch's ReLU MLP: the quantized kernel equals the float kernel on
    the dequantized matrices (and the biases, kept in bf16)."""
    from moetier.model.expert_kernels import dense_expert
    from moetier.store.store import Store

    _, path = tiny_store(family)
    store = Store(path)
    spec = store.spec
    native = store.read_expert(spec.moe_layers[0], 3)
    w = quantize_expert(native, precision)
    kernel = make_expert_kernel(precision, TorchKernels(), torch.float32, spec)
    assert isinstance(kernel, QuantizedExpert) and kernel.dense_kernel is not None
    x, weights = torch.randn(5, spec.hidden_size), torch.rand(5)
    out = torch.full_like(x, float("nan"))
    kernel(out, x, w, weights)
    dense = {name: dequantize(q, torch.float32) for name, q in expert_matrices(w, precision).items()}
    dense.update({name: t.float() for name, t in w.items() if name.endswith(".bias")})
    ref = torch.empty_like(x)
    dense_expert(TorchKernels(), spec)(ref, x, dense, weights)
    assert torch.equal(out, ref)
    # and the quantized copy is near the float expert (its error is the quantizer's: int4 of 64 random weights a
    # group errs by ~10%)
    exact = torch.empty_like(x)
    dense_expert(TorchKernels(), spec)(exact, x, native, weights)
    assert (out - exact).abs().max() < {"int8": 0.05, "int4": 0.25}[precision] * exact.abs().max()
