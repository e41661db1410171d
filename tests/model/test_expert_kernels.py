"""Quantized experts computed from their codes (native and torch paths) against the dequantized reference."""

import pytest
import torch

from moetier.model import native
from moetier.model.expert_kernels import TOKENS_A_CALL, DenseExpert, QuantizedExpert, make_expert_kernel
from moetier.model.gemm_precision import integer_tokens
from moetier.model.kernels import NativeKernels, TorchKernels
from moetier.quant.codes import BITS, MATRICES, Quantized, dequantize, expert_matrices, quantize_expert
from tests.model.isas import isa_params

LIB = native.load().lib
needs_native = pytest.mark.skipif(LIB is None, reason="no native kernels on this machine")
# every library this CPU runs (AVX2, AVX-512 VNNI, ...), and those it cannot, skipped with the reason
ISAS = isa_params()


def expert(h, i, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"gate_up_proj": (torch.randn(2 * i, h, generator=g) / h ** 0.5).bfloat16(),
            "down_proj": (torch.randn(h, i, generator=g) / i ** 0.5).bfloat16()}


def reference(x, q: dict[str, Quantized], weights):
    """The expert with its dequantized bf16 weights, through torch's ops."""
    out = torch.empty_like(x)
    TorchKernels().expert(out, x, dequantize(q["gate_up_proj"]), dequantize(q["down_proj"]), weights)
    return out


def integer_emulation(x, q: dict[str, Quantized], weights, lib):
    """csrc/q_int.c's arithmetic in torch (fp64): activations quantized to int8 per block (dx = max|x| / 127, round
    half to even; the block the library takes for the matrix: 128 inputs for int8 rows and int4 groups, else 32),
    the weights exact ((q - mid) * s + z, not rounded to bf16), each group's zero term on the unquantized
    activations; rounded to bf16 where the kernel rounds."""
    def matmul(a, m: Quantized):  # a [T, K] fp64 -> [T, N]
        k = a.shape[1]
        group = k if m.zeros is None else k // m.scales.shape[1]
        block = lib.moetier_qi_block(BITS[m.precision], k, group)
        blocks = a.float().view(a.shape[0], -1, block)
        amax = blocks.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 127 / amax, 0)  # in fp32, as the kernel: x * (127 / amax), not x / dx
        dx = (amax / 127).double()
        aq = (torch.round(blocks * inv).double() * dx).view_as(a)
        n, k = m.scales.shape[0], a.shape[1]
        scales = m.scales.double().view(n, -1)
        group = k // scales.shape[1]
        codes = unpack(m).double()  # [N, K]
        if m.zeros is None:  # int8: w = q * s
            return aq @ (codes * scales.repeat_interleave(group, 1)).T
        mid = 1 << (BITS[m.precision] - 1)
        w_codes = (codes - mid) * scales.repeat_interleave(group, 1)
        zeros = m.zeros.double().view(n, -1).repeat_interleave(group, 1)
        return aq @ w_codes.T + a @ zeros.T

    gate, up = matmul(x.double(), q["gate_up_proj"]).chunk(2, dim=-1)
    bf = lambda t: t.bfloat16().double()  # noqa: E731
    gate = bf(gate)
    h = bf(bf(gate * torch.sigmoid(gate)) * bf(up))
    return (bf(matmul(h, q["down_proj"])) * weights.double()[:, None]).bfloat16()


def unpack(m: Quantized) -> torch.Tensor:
    """The integer codes [N, K] (int8's signed), the packed ones unpacked (input per*j + i in bits i*bits of byte j)."""
    bits = BITS[m.precision]
    c = m.codes.to(torch.int16)
    if bits == 8:
        return c
    return torch.stack([(c >> (bits * i)) & ((1 << bits) - 1) for i in range(8 // bits)], dim=-1).view(c.shape[0], -1)


SHAPES = [(256, 128), (64, 48), (512, 1024), (2048, 1408), (2048, 1024)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("integer", [True, False], ids=["integer", "float-unpack"])
@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
@pytest.mark.parametrize("h, i", SHAPES)
@pytest.mark.parametrize("tokens", [1, 3, 4, 9, 40])
def test_native_expert_matches_the_dequantized_reference(isa, integer, precision, h, i, tokens):
    w = quantize_expert(expert(h, i), precision)
    g = torch.Generator().manual_seed(h + i + tokens)
    x = torch.randn(tokens, h, generator=g).bfloat16()
    weights = torch.rand(tokens, generator=g).bfloat16()
    kernel = QuantizedExpert(precision, TorchKernels(), torch.bfloat16, native.load(isa).lib, integer=integer,
                             bf16_gemm=True)  # (40 tokens: the dequantized GEMM, as where the CPU has bf16 dots)
    out = torch.full_like(x, float("nan"))
    kernel(out, x, w, weights)
    ref = reference(x, expert_matrices(w, precision), weights)
    # the weights are exact in the kernel and bf16-rounded in the reference: agreement to bf16's precision, and for
    # the integer path to the activations' int8 rounding (1.3-2% of the output's mean size on random experts)
    torch.testing.assert_close(out.float(), ref.float(), atol=0.05 * ref.float().abs().max().item(), rtol=0.05)
    mean_error = 0.03 if integer and tokens <= kernel.integer_tokens and (h, i) != (64, 48) else 0.01
    assert (out.float() - ref.float()).abs().mean() < mean_error * ref.float().abs().mean() + 1e-6


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
def test_a_prompt_without_bf16_dot_products_is_the_passes_bit_for_bit(isa, precision):
    """Where torch's bf16 GEMM is slow (moetier/model/gemm_precision.py) an expert's prompt tokens are computed from
    the codes, 4 a pass, each row read once for a call's tokens (TOKENS_A_CALL: more make calls of that many): what
    each pass computes alone, bit for bit, at every remainder (down's 256 rows in ragged tiles: csrc/q_int.c
    tile_rows)."""
    h, i = 256, 384
    w = quantize_expert(expert(h, i, seed=7), precision)
    kernel = QuantizedExpert(precision, TorchKernels(), torch.bfloat16, native.load(isa).lib, bf16_gemm=False)
    g = torch.Generator().manual_seed(7)
    for tokens in (5, 8, 11, TOKENS_A_CALL + 5):
        x = torch.randn(tokens, h, generator=g).bfloat16()
        weights = torch.rand(tokens, generator=g).bfloat16()
        whole, passes = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        kernel(whole, x, w, weights)
        for a in range(0, tokens, 4):
            kernel(passes[a:a + 4], x[a:a + 4].contiguous(), w, weights[a:a + 4])
        assert torch.equal(whole, passes)


@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
def test_with_a_fast_bf16_gemm_an_expert_of_a_few_dozen_tokens_still_takes_the_codes(precision):
    """Beside a fast bf16 GEMM, up to gemm_precision.integer_tokens tokens an expert are computed from the codes (what
    the kernels compute where that GEMM is slow, bit for bit), one more through the dequantized matrices' GEMM."""
    lib = native.load().lib
    h, i = SHAPES[0]
    w = quantize_expert(expert(h, i, seed=3), precision)
    kernel = QuantizedExpert(precision, TorchKernels(), torch.bfloat16, lib, bf16_gemm=True)
    codes = QuantizedExpert(precision, TorchKernels(), torch.bfloat16, lib, bf16_gemm=False)
    limit = kernel.integer_tokens
    assert 4 < limit == integer_tokens(precision, True) < integer_tokens(precision, False)
    g = torch.Generator().manual_seed(3)
    for tokens in (limit, limit + 1):
        x = torch.randn(tokens, h, generator=g).bfloat16()
        weights = torch.rand(tokens, generator=g).bfloat16()
        out, from_codes = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        kernel(out, x, w, weights)
        codes(from_codes, x, w, weights)
        assert torch.equal(out, from_codes) == (tokens <= limit)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
@pytest.mark.parametrize("h, i", [s for s in SHAPES if s != (64, 48)])  # (48 inputs: no whole blocks of 32)
@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_integer_path_computes_what_it_says(isa, precision, h, i, tokens):
    """The integer kernel against an emulation of its own arithmetic: what is left is the order of the sums, which
    may move a g or u across a bf16 rounding boundary and so requantize an activation block of h (seen: up to 0.4%
    of the output's mean size; a misplaced code or scale costs tens of percent)."""
    lib = native.load(isa).lib
    w = quantize_expert(expert(h, i, seed=tokens), precision)
    q = expert_matrices(w, precision)
    assert lib.moetier_qi_fits(BITS[precision], h, h // q["gate_up_proj"].scales.view(2 * i, -1).shape[1])
    g = torch.Generator().manual_seed(h + i + tokens)
    x = torch.randn(tokens, h, generator=g).bfloat16()
    weights = torch.rand(tokens, generator=g).bfloat16()
    out = torch.full_like(x, float("nan"))
    QuantizedExpert(precision, TorchKernels(), torch.bfloat16, lib)(out, x, w, weights)
    emulated = integer_emulation(x, q, weights, lib).float()
    err = (out.float() - emulated).abs()
    assert err.mean() < 0.008 * emulated.abs().mean() and err.max() < 0.03 * emulated.abs().max()


@needs_native
def test_shapes_the_integer_path_does_not_tile_are_unpacked_to_floats():
    assert not LIB.moetier_qi_fits(4, 48, 48) and not LIB.moetier_qi_fits(4, 256, 100)
    assert LIB.moetier_qi_fits(8, 64, 64) and LIB.moetier_qi_fits(2, 1408, 64) and LIB.moetier_qi_fits(4, 2048, 128)
    kernel = QuantizedExpert("int4", TorchKernels(), torch.bfloat16, LIB)
    assert kernel._fits(64, 48, 64, 48) is False and kernel._fits(256, 128, 128, 128) is True


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


def layer_of(kernel, experts, counts, h, seed=0):
    """`kernel.layer` and one call an expert on the same pairs: experts[j] takes counts[j] rows of xs, in order, with
    a row no expert takes between each (as a plan whose other experts wait for reads leaves them): (both ys)."""
    g = torch.Generator().manual_seed(seed)
    spans, row = [], 0
    for c in counts:
        spans.append((row, row + c))
        row += c + 1
    xs = torch.randn(row, h, generator=g).bfloat16()
    weights = torch.rand(row, generator=g).bfloat16()
    items = [(w, a, b) for w, (a, b) in zip(experts, spans)]
    together, alone = torch.zeros_like(xs), torch.zeros_like(xs)
    kernel.layer(together, xs, weights, items)
    for w, a, b in items:
        kernel(alone[a:b], xs[a:b], w, weights[a:b])
    return together, alone


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
@pytest.mark.parametrize("counts", [[1] * 8, [1, 3, 4, 2], [2], [2, 9, 1, 5, 3]])  # (9, 5: one by one beside it)
def test_a_layers_experts_in_one_call_are_one_call_each_bit_for_bit(isa, precision, counts):
    h, i = 512, 256
    experts = [quantize_expert(expert(h, i, seed=j), precision) for j in range(len(counts))]
    kernel = QuantizedExpert(precision, TorchKernels(), torch.bfloat16, native.load(isa).lib)
    together, alone = layer_of(kernel, experts, counts, h)
    assert torch.equal(together, alone) and alone.abs().sum() > 0


@pytest.mark.parametrize("isa", ISAS)
def test_a_layers_bf16_experts_in_one_call_are_one_call_each_bit_for_bit(isa):
    h, i = 512, 320  # (320: a tail past the last full block of 16, as permuted() leaves it)
    experts = [expert(h, i, seed=j) for j in range(8)]
    kernel = DenseExpert(NativeKernels(native.load(isa).lib, isa))
    together, alone = layer_of(kernel, experts, [1] * 8, h)
    assert torch.equal(together, alone) and alone.abs().sum() > 0
    together, alone = layer_of(kernel, experts[:3], [1, 2, 1], h)  # two tokens: one call each, as before
    assert torch.equal(together, alone)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
@pytest.mark.parametrize("n", [1, 8])
def test_one_token_through_a_layers_experts_is_the_layer_and_the_combine_bit_for_bit(isa, precision, n):
    h, i = 512, 256
    ws = [quantize_expert(expert(h, i, seed=j), precision) for j in range(n)]
    kernels = NativeKernels(native.load(isa).lib, isa)
    kernel = QuantizedExpert(precision, kernels, torch.bfloat16, native.load(isa).lib)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(1, h, generator=g).bfloat16()
    weights = torch.rand(n, generator=g).bfloat16()
    fused = torch.full_like(x, float("nan"))
    kernel.token(fused, x, weights, ws, kernels.combine)
    xs, ys = x.expand(n, h).contiguous(), torch.empty(n, h, dtype=torch.bfloat16)
    kernel.layer(ys, xs, weights, [(w, e, e + 1) for e, w in enumerate(ws)])
    grouped = kernels.combine(x, torch.zeros(n, dtype=torch.long), ys)
    assert torch.equal(fused, grouped) and grouped.abs().sum() > 0


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [1, 8])
def test_one_token_through_a_layers_bf16_experts_is_the_layer_and_the_combine_bit_for_bit(isa, n):
    h, i = 512, 320  # (320: a tail past the last full block of 16)
    items = [(e["gate_up_proj"], e["down_proj"]) for e in (expert(h, i, seed=j) for j in range(n))]
    kernels = NativeKernels(native.load(isa).lib, isa)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(1, h, generator=g).bfloat16()
    weights = torch.rand(n, generator=g).bfloat16()
    fused = torch.full_like(x, float("nan"))
    kernels.expert_token(fused, x, weights, items)
    grouped = torch.full_like(x, float("nan"))
    TorchKernels.expert_token(kernels, grouped, x, weights, items)  # copies of the row, expert_layer, combine
    assert torch.equal(fused, grouped) and grouped.abs().sum() > 0


@pytest.mark.skipif("avx2-vnni" not in native.runnable_isas(), reason="this CPU has no AVX-VNNI (avx_vnni)")
@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_the_vnni_library_computes_the_avx2_librarys_bits(precision, tokens):
    """vpdpbusd sums the same integer products as AVX2's vpmaddubsw/vpmaddwd (which never saturate here): the same
    outputs, bit for bit, at batch 1 (paired rows) and over a few tokens."""
    h, i = 512, 1024
    w = quantize_expert(expert(h, i, seed=11), precision)
    g = torch.Generator().manual_seed(11 + tokens)
    x = torch.randn(tokens, h, generator=g).bfloat16()
    weights = torch.rand(tokens, generator=g).bfloat16()
    outs = []
    for isa in ("avx2", "avx2-vnni"):
        kernel = QuantizedExpert(precision, TorchKernels(), torch.bfloat16, native.load(isa).lib, bf16_gemm=False)
        out = torch.full_like(x, float("nan"))
        kernel(out, x, w, weights)
        outs.append(out)
    assert native.load("avx2-vnni").lib.moetier_qi_isa().decode() == "avx2-vnni"
    assert torch.equal(*outs)
