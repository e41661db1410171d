"""The native kernels on GGML's block formats (csrc/q_ggml.c), on every instruction set this CPU runs: against the
same arithmetic in torch — the activation quantized to Q8_K / Q8_0 blocks as ggml quantizes it, times the
dequantized weights — to fp32 rounding, and against the float product within the activation's int8 rounding."""

import pytest
import torch

from moetier.model import native
from moetier.model.gemm_precision import INTEGER_TOKENS, integer_tokens
from moetier.model.ggml_linear import MAX_TOKENS, GgmlLinear
from moetier.quant.ggml_blocks import dequantize
from moetier.quant.kquants import quantize
from moetier.quant.precisions import matrix_shape
from tests.model.isas import isa_params

ISAS = isa_params()
FORMATS = ["q8_0", "q4_k", "q5_k", "q6_k", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4"]
READ_ONLY_TYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1", "mxfp4": "MXFP4"}


def quantize_any(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Our ggml-exact quantizer; for the formats moetier only reads (legacy, MXFP4) the gguf package's."""
    if fmt not in READ_ONLY_TYPES:
        return quantize(w, fmt)
    import gguf

    return torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[READ_ONLY_TYPES[fmt]]))


@pytest.fixture(scope="module", params=ISAS)
def linear(request) -> GgmlLinear:
    loaded = native.load(request.param)
    assert loaded.lib is not None, loaded.reason
    return GgmlLinear(loaded.lib)


def activation_as_ggml(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [T, K] -> the values its int8 blocks stand for: Q8_K (256, scale from the signed largest, -127 / it, at
    most 127) for the k-quants; 32 a block by max |x| / 127 for q8_0."""
    t, k = x.shape
    if fmt == "q8_0" or fmt in READ_ONLY_TYPES:  # Q8_0-like blocks of 32
        b = x.view(t, k // 32, 32)
        d = b.abs().amax(-1, keepdim=True) / 127
        return (torch.round(b / torch.where(d > 0, d, 1)) * d).view(t, k)
    b = x.view(t, k // 256, 256)
    big = b.gather(-1, b.abs().argmax(-1, keepdim=True))
    iscale = torch.where(big != 0, -127 / big, 0)
    q = torch.round(iscale * b).clamp(max=127)
    return (q * torch.where(iscale != 0, 1 / iscale, 0)).view(t, k)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [1, 3, MAX_TOKENS])
def test_the_kernel_is_ggmls_arithmetic(linear, fmt, tokens):
    g = torch.Generator().manual_seed(tokens)
    w = quantize_any(torch.randn(96, 512, generator=g) * 0.02, fmt)
    x = torch.randn(tokens, 512, generator=g)
    y = linear(x, w, fmt)
    want = (activation_as_ggml(x, fmt).double() @ dequantize(w, fmt).double().T).float()
    torch.testing.assert_close(y, want, rtol=2e-5, atol=1e-5)
    exact = x @ dequantize(w, fmt).T  # the activation's int8 rounding is all that parts them
    assert ((y - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize("tokens", [1, 2, MAX_TOKENS])
def test_mxfp4_rows_of_an_odd_number_of_blocks_over_a_range_of_exponents(linear, tokens):
    """MXFP4 two blocks at a time (the activation laid out in pairs) and a last odd block alone: 15 blocks a row,
    rows scaled from 2^-6 to 2^1 (blocks' exponents over a range of the scale table)."""
    g = torch.Generator().manual_seed(tokens)
    w = quantize_any(torch.randn(64, 480, generator=g) * torch.logspace(-6, 1, 64, base=2.0)[:, None], "mxfp4")
    x = torch.randn(tokens, 480, generator=g)
    want = (activation_as_ggml(x, "mxfp4").double() @ dequantize(w, "mxfp4").double().T).float()
    torch.testing.assert_close(linear(x, w, "mxfp4"), want, rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, MAX_TOKENS])
def test_mxfp4_scales_of_every_exponent_in_every_lane(linear, tokens):
    """Eight blocks at a time the kernel computes the blocks' scales 2^(e - 128) from their E8M0 bytes (the
    subnormal ones of e 0 and 1 apart) where the pairs and the odd last block look them up: rows of 11 blocks (an
    octet, a pair, an odd one), row e's blocks all of exponent e, so each exponent meets every lane of the octet.
    Exponents up to 127 against a large activation, the rest against a small one (their products within fp32); the
    reference dequantizes each row with its exponents moved 64 towards the middle (fp32 holds 2^127 * 6 as no
    weight) and moves its products back in float64; a scale one step off would be 2^+-1 off."""
    g = torch.Generator().manual_seed(tokens)
    blocks = torch.randint(0, 256, (256, 11, 17), generator=g, dtype=torch.uint8)
    blocks[:, :, 0] = torch.arange(256, dtype=torch.uint8)[:, None]
    for rows, scale, shift in ((slice(0, 128), 2.0 ** 100, 64), (slice(128, 256), 2.0 ** -100, -64)):
        x = torch.randn(tokens, 352, generator=g) * scale
        moved = blocks[rows].clone()
        moved[:, :, 0] += shift
        w_moved = dequantize(moved.view(128, 11 * 17), "mxfp4").double()
        xq = activation_as_ggml(x, "mxfp4").double()
        want, size = xq @ w_moved.T * 2.0 ** -shift, xq.abs() @ w_moved.abs().T * 2.0 ** -shift  # [tokens, 128]
        got = linear(x, blocks[rows].reshape(128, 11 * 17), "mxfp4").double()
        assert ((got - want).abs() <= 1e-6 * size).all()  # fp32 roundings of the blocks' sums, not of a scale


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_big_matrix_in_parallel_and_a_long_batch_by_dequantizing(linear, fmt):
    g = torch.Generator().manual_seed(1)
    w = quantize_any(torch.randn(512, 1024, generator=g) * 0.02, fmt)  # over the threads' threshold
    x = torch.randn(MAX_TOKENS + 2, 1024, generator=g)
    rows = torch.cat([linear(x[i:i + 2], w, fmt) for i in range(0, len(x), 2)])
    whole = linear(x, w, fmt)  # more tokens than a pass: dequantized, torch's product
    torch.testing.assert_close(whole, x @ dequantize(w, fmt).T)
    assert ((rows - whole).norm() / whole.norm()).item() < 0.02
    # a bf16 model's long prefill where the CPU has bf16 dot products: torch's bf16 GEMM on the values rounded to
    # bf16 (without them, or for fewer tokens: the kernels' passes, test_a_prompt_without_bf16_dot_products_...)
    xb = torch.randn(2 * max(INTEGER_TOKENS.values()), 1024, generator=g).bfloat16()
    bf16_gemm = GgmlLinear(linear.lib, bf16_gemm=True)
    torch.testing.assert_close(bf16_gemm(xb, w, fmt), (xb @ dequantize(w, fmt).bfloat16().T).float(), rtol=0, atol=0)


def test_weights_of_the_wrong_size_are_refused(linear):
    with pytest.raises(ValueError, match=r"uint8 \[N, 144\]"):
        linear(torch.zeros(1, 256), torch.zeros(4, 140, dtype=torch.uint8), "q4_k")


@pytest.mark.parametrize("tokens", [1, 2, MAX_TOKENS, 9, min(INTEGER_TOKENS.values())])
@pytest.mark.parametrize("gu_fmt,d_fmt", [("q4_k", "q6_k"), ("q4_k", "q4_k"), ("q5_k", "q8_0"), ("q8_0", "q6_k"),
                                          ("q4_k", "q5_0"), ("q4_0", "q4_1"), ("q5_1", "q4_k"), ("mxfp4", "mxfp4")])
def test_one_call_computes_an_expert_as_the_ops_one_by_one(linear, gu_fmt, d_fmt, tokens):
    """moetier_gq_swiglu (one native call an expert, a prompt's tokens too: each row read once for all of them)
    against GgmlExpert's torch ops around the same kernels: the same bf16 roundings, so the same bits."""
    from moetier.model.ggml_experts import GgmlExpert

    torch.manual_seed(tokens)
    h, i = 512, 256
    # (as a slot views them: a legacy format's matrix [N, blocks, block bytes], so its shape tells it from a
    # k-quant of as many bytes)
    w = {"gate_up_proj": quantize_any(torch.randn(2 * i, h) * 0.05, gu_fmt).view(matrix_shape(gu_fmt, 2 * i, h)),
         "down_proj": quantize_any(torch.randn(h, i) * 0.05, d_fmt).view(matrix_shape(d_fmt, h, i))}
    x = torch.randn(tokens, h).bfloat16()
    weights = torch.rand(tokens).bfloat16()
    fused, ops = GgmlExpert(gu_fmt, torch.bfloat16, linear.lib), GgmlExpert(gu_fmt, torch.bfloat16, linear.lib)
    ops.fused = False
    a, b = torch.empty(tokens, h, dtype=torch.bfloat16), torch.empty(tokens, h, dtype=torch.bfloat16)
    fused(a, x, w, weights)
    ops(b, x, w, weights)
    assert fused.fused and torch.equal(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_dequantization_is_ggml_blocks_bit_for_bit(linear, fmt):
    """A prefill's matrix dequantized natively (moetier_gq_dequantize) equals the torch dequantizer, which equals
    gguf's (tests/quant/test_ggml_blocks.py), on blocks that take every code and scale."""
    torch.manual_seed(0)
    w = quantize_any(torch.randn(96, 512) * torch.logspace(-3, 0, 96)[:, None], fmt)
    assert torch.equal(linear.dequantize(w, fmt, 512), dequantize(w, fmt))
    assert torch.equal(linear.dequantize(w, fmt, 512, torch.bfloat16), dequantize(w, fmt).bfloat16())


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_prompt_without_bf16_dot_products_is_the_kernels_passes_bit_for_bit(linear, fmt):
    """Where torch's bf16 GEMM is slow (no bf16 dot products: gemm_precision), a bf16 prompt's tokens go through the
    integer kernels, each row once for all of them (moetier_gq_linear_tokens): what the passes of 4 compute one by
    one, bit for bit, at every remainder; with bf16 dot products too, up to gemm_precision.integer_tokens, and the
    dequantized matrix's GEMM beyond."""
    torch.manual_seed(3)
    w = quantize_any(torch.randn(200, 512) * 0.05, fmt)  # (200 rows: ragged tiles, GQ_TILE_BYTES)
    slow, fast = GgmlLinear(linear.lib, bf16_gemm=False), GgmlLinear(linear.lib, bf16_gemm=True)
    limit = integer_tokens(fmt, True)
    for t in (5, 8, 11, 19, limit, limit + 1, 64):
        x = torch.randn(t, 512).bfloat16()
        passes = torch.cat([slow(x[i:i + MAX_TOKENS], w, fmt) for i in range(0, t, MAX_TOKENS)])
        assert slow.passes(x, fmt) and torch.equal(slow(x, w, fmt), passes)
        if t <= limit:
            assert fast.passes(x, fmt) and torch.equal(fast(x, w, fmt), passes)
        else:
            assert not fast.passes(x, fmt)
            assert torch.equal(fast(x, w, fmt), (x @ dequantize(w, fmt).bfloat16().T).float())
    x32 = torch.randn(9, 512)  # (an fp32 model's prompt keeps the fp32 GEMM: the parity tests' arithmetic)
    assert not slow.passes(x32, fmt) and torch.allclose(slow(x32, w, fmt), x32 @ dequantize(w, fmt).T)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q5_k", "q6_k"])
def test_a_block_whose_scale_is_not_finite_dequantizes_as_the_torch_dequantizer(linear, fmt):
    """The bf16 dequantizers run eight values at a time (their own rounding to bf16): a damaged file's block whose
    fp16 scale is infinite or NaN gives what the reference gives — the same infinities, NaN where it has NaN (a NaN's
    bits are not compared: ours is the quiet 0x7fc0 c10::BFloat16 writes, torch's vectorised cast keeps others)."""
    torch.manual_seed(1)
    w = quantize(torch.randn(4, 256) * 0.1, fmt).clone()
    at = 208 if fmt == "q6_k" else 0  # where a row's first block keeps its (first) fp16 scale
    for row, value in enumerate((0x7C00, 0xFC00, 0x7FFF)):  # +inf, -inf, a NaN whose payload rounds up and over; the
        # fourth row as quantized
        w[row, at:at + 2] = torch.tensor([value & 0xFF, value >> 8], dtype=torch.uint8)
    got = linear.dequantize(w, fmt, 256, torch.bfloat16).float()
    want = dequantize(w, fmt).bfloat16().float()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(linear.dequantize(w, fmt, 256), dequantize(w, fmt), rtol=0, atol=0, equal_nan=True)
    assert got[2].isnan().any() and got[0].isinf().any() and got[3].isfinite().all()


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mixed", [False, True])
def test_a_tokens_experts_in_one_call_are_token_bit_for_bit(linear, weights_dtype, mixed):
    """moetier_gq_swiglu_token_routed (a layer's resident experts from the router's ids and weights, unordered; all
    in one parallel region, x quantized once per gate_up type) against `token`: each expert one call, in ascending
    ids, summed by the kernels' combine. `mixed`: two of the chosen experts in other types than the rest (x then
    quantized for each type)."""
    from moetier.model.ggml_experts import GgmlExpert

    torch.manual_seed(5)
    h, i = 512, 256
    types = {1: ("q8_0", "q4_k"), 3: ("q5_k", "q8_0")} if mixed else {}
    ws = [{"gate_up_proj": quantize(torch.randn(2 * i, h) * 0.05, types.get(e, ("q4_k", "q6_k"))[0]),
           "down_proj": quantize(torch.randn(h, i) * 0.05, types.get(e, ("q4_k", "q6_k"))[1])} for e in range(6)]
    expert = GgmlExpert("q4_k", torch.bfloat16, linear.lib)
    table = expert.token_table(ws)
    x = torch.randn(1, h).bfloat16()
    ids = torch.tensor([[4, 1, 3]])
    weights = torch.rand(1, 3).to(weights_dtype)

    def combine(x, token_of, ys):  # NativeKernels.combine for one token
        y = torch.empty_like(x)
        linear.lib.moetier_sum_rows_bf16(ys.data_ptr(), ys.shape[0], ys.shape[1], y.data_ptr())
        return y

    order = ids[0].argsort()
    want, got = torch.empty(1, h, dtype=torch.bfloat16), torch.empty(1, h, dtype=torch.bfloat16)
    expert.token(want, x, weights[0][order], [ws[e] for e in ids[0][order].tolist()], combine)
    assert table is not None and table.takes(x, ids, weights)
    expert.token_routed(got, x, ids, weights, table)
    assert torch.equal(got, want)


@pytest.mark.parametrize("mixed", [False, True])
def test_a_layers_experts_in_one_call_are_one_call_an_expert_bit_for_bit(linear, mixed):
    """GgmlExpert.layer (a batch's decode step: each expert a few of the pairs' rows) through moetier_gq_swiglu_layer
    — one parallel region — against `__call__` on each expert's rows: the same bits. Experts of 1 to 4 rows in one
    call, one of 6 rows one by one beside it (more than a pass), one with none; `mixed`: experts of other types
    among them (each pair's row quantized for its expert's type). Rows no expert takes keep what was there."""
    from moetier.model.ggml_experts import GgmlExpert

    torch.manual_seed(7)
    h, i = 512, 256
    types = {1: ("q8_0", "q4_k"), 3: ("q5_k", "q8_0"), 4: ("q4_0", "q5_1")} if mixed else {}
    ws = [{"gate_up_proj": quantize_any(torch.randn(2 * i, h) * 0.05, types.get(e, ("q4_k", "q6_k"))[0]),
           "down_proj": quantize_any(torch.randn(h, i) * 0.05, types.get(e, ("q4_k", "q6_k"))[1])} for e in range(6)]
    for w, e in zip(ws, range(6)):  # (as a slot views a legacy format's matrix: [N, blocks, block bytes])
        gu, d = types.get(e, ("q4_k", "q6_k"))
        w["gate_up_proj"] = w["gate_up_proj"].view(matrix_shape(gu, 2 * i, h))
        w["down_proj"] = w["down_proj"].view(matrix_shape(d, h, i))
    rows = [3, 1, 6, 4, 0, 2]  # expert e's rows, in order
    edges = [0, *torch.tensor(rows).cumsum(0).tolist()]
    p = edges[-1] + 2  # two rows no expert takes
    xs = torch.randn(p, h).bfloat16()
    weights = torch.rand(p)  # (the router's fp32: rounded to bf16 as one call an expert rounds them)
    items = [(w, a, b) for w, a, b in zip(ws, edges, edges[1:])]
    expert = GgmlExpert("q4_k", torch.bfloat16, linear.lib)
    calls = []
    expert.linear.lib = _Counting(linear.lib, calls)
    want = torch.full((p, h), 7.0, dtype=torch.bfloat16)
    got = want.clone()
    for w, a, b in items:
        expert(want[a:b], xs[a:b], w, weights[a:b])
    calls.clear()
    expert.layer(got, xs, weights, items)
    assert calls.count("moetier_gq_swiglu_layer") == 1  # the experts of at most a pass's rows: one call
    assert calls.count("moetier_gq_swiglu") == 1  # the 6-row one on its own
    assert torch.equal(got, want)



def gpt_oss_experts(n: int, h: int, i: int) -> list[dict[str, torch.Tensor]]:
    """n gpt-oss experts as its GGUFs hold them: MXFP4 blocks (as a slot views them), fp32 biases; wide enough
    that the clamps bite (|gate_up| past 7 for some rows)."""
    return [{"gate_up_proj": quantize_any(torch.randn(2 * i, h) * 0.4, "mxfp4").view(matrix_shape("mxfp4", 2 * i, h)),
             "down_proj": quantize_any(torch.randn(h, i) * 0.05, "mxfp4").view(matrix_shape("mxfp4", h, i)),
             "gate_up_proj.bias": torch.randn(2 * i), "down_proj.bias": torch.randn(h) * 0.1} for _ in range(n)]


def test_gpt_oss_experts_in_one_call_are_the_torch_ops_bit_for_bit(linear):
    """GgmlClampedExpert's native calls — a layer's experts (moetier_gq_glu_layer) and a token's straight from the
    router's ids (moetier_gq_glu_token_routed) — against its torch ops one expert at a time (`__call__`: bias, clamp,
    gate·sigmoid(alpha·gate)·(up + 1), each rounded to bf16 as torch rounds it): the same bits."""
    from moetier.model.expert_kernels import TokenTable
    from moetier.model.ggml_experts import GgmlClampedExpert

    torch.manual_seed(5)
    h, i = 256, 192
    ws = gpt_oss_experts(6, h, i)
    expert = GgmlClampedExpert("mxfp4", torch.bfloat16, 1.702, 7.0, linear.lib)
    calls = []
    expert.linear.lib = _Counting(linear.lib, calls)
    rows = [3, 1, 6, 4, 0, 2]
    edges = [0, *torch.tensor(rows).cumsum(0).tolist()]
    xs = torch.randn(edges[-1], h).bfloat16()
    weights = torch.rand(edges[-1])
    items = [(w, a, b) for w, a, b in zip(ws, edges, edges[1:])]
    want = torch.empty(edges[-1], h, dtype=torch.bfloat16)
    for w, a, b in items:
        expert(want[a:b], xs[a:b], w, weights[a:b])
    got = torch.empty_like(want)
    calls.clear()
    expert.layer(got, xs, weights, items)
    assert calls.count("moetier_gq_glu_layer") == 1 and torch.equal(got, want)
    clamped = (expert.linear(xs, ws[0]["gate_up_proj"], "mxfp4") + ws[0]["gate_up_proj.bias"]).abs() > 7
    assert clamped.any()  # (the clamps were met)

    table = expert.token_table(ws)
    assert isinstance(table, TokenTable) and table.ptrs.shape == (6, 6)
    x = xs[:1].contiguous()
    ids, topk = torch.tensor([[4, 1, 5]]), torch.rand(1, 3)
    one = torch.empty(3, h, dtype=torch.bfloat16)
    for j, e in enumerate(ids[0].tolist()):
        expert(one[j:j + 1], x, ws[e], topk[0, j:j + 1])
    order = ids[0].argsort()  # (summed in ascending ids, in fp32, as the kernels' combine sums)
    want = one[order].float().sum(0, keepdim=True).bfloat16()
    got = torch.empty(1, h, dtype=torch.bfloat16)
    calls.clear()
    expert.token_routed(got, x, ids, topk, table)
    assert calls.count("moetier_gq_glu_token_routed") == 1 and torch.equal(got, want)
    assert expert.token_table([{**w, "down_proj.bias": w["down_proj.bias"].bfloat16()} for w in ws]) is None


@pytest.mark.skipif(len(native.runnable_isas()) < 2, reason="this CPU runs one instruction set's library only")
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_library_computes_the_same_bits(fmt):
    """The AVX-512 library's blocks multiply and add in one instruction (VNNI's vpdpwssd / vpdpbusd) where the AVX2
    library takes two or three: the same integer sums, so the same outputs at every token count of a pass."""
    torch.manual_seed(11)
    w = quantize_any(torch.randn(96, 512) * 0.05, fmt)
    x = torch.randn(MAX_TOKENS, 512)
    outs = [[GgmlLinear(native.load(isa).lib)(x[:t], w, fmt) for t in range(1, MAX_TOKENS + 1)]
            for isa in native.runnable_isas()]
    assert all(torch.equal(a, b) for other in outs[1:] for a, b in zip(outs[0], other))

class _Counting:
    """A native library whose calls are named in `calls` as they are made."""

    def __init__(self, lib, calls: list[str]) -> None:
        self._lib, self._calls = lib, calls

    def __getattr__(self, name: str):
        fn = getattr(self._lib, name)

        def call(*args):
            self._calls.append(name)
            return fn(*args)
        return call


@pytest.mark.skipif("avx2-vnni" not in native.runnable_isas(), reason="this CPU has no AVX-VNNI (avx_vnni)")
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_vnni_library_computes_the_avx2_librarys_bits(fmt):
    """q_ggml.c's products with AVX-VNNI (vpdpbusd, vpdpwssd) sum what AVX2's never-saturating sequences sum: every
    format's outputs the same, bit for bit, at 1, 3 and a call's most tokens (tests/model/isas.py: why the library
    is checked so, and not by each test again)."""
    g = torch.Generator().manual_seed(5)
    w = quantize_any(torch.randn(96, 512, generator=g) * 0.02, fmt)
    for tokens in (1, 3, MAX_TOKENS):
        x = torch.randn(tokens, 512, generator=g)
        avx2, vnni = (GgmlLinear(native.load(isa).lib)(x, w, fmt) for isa in ("avx2", "avx2-vnni"))
        assert torch.equal(avx2, vnni), (fmt, tokens)
