"""The Triton kernels of a layer's experts, bf16 and quantized (moetier/model/triton_experts.py): on a GPU where
there is one; else, where triton is installed, in its interpreter on the CPU (which rounds to bf16 by truncation, not
to nearest: the checks say which they hold to). Skipped where triton is not installed (CI: it is the GPU machine's,
not a dependency); on the CPU, but for the compile tests, where its interpreter cannot run (tests/triton_here.py)."""

import importlib.util
import os

import pytest
import torch

from tests.triton_here import skip_interpreted

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton is first imported)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the GPU machine's)")
DEVICE = "cuda" if CUDA else "cpu"

from moetier.model.expert_kernels import DenseExpert, QuantizedExpert, make_expert_kernel  # noqa: E402
from moetier.model.kernels import CudaKernels, TorchKernels, TritonKernels  # noqa: E402
from moetier.quant.codes import BITS, Quantized, dequantize, quantize_expert  # noqa: E402

if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    from moetier.model.triton_kernels import ggml_block, weights_block

    @triton.jit
    def dump(codes, scales, zeros, out, stride_c, stride_s, K, BITS: tl.constexpr, GROUP: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr):
        """Every weight `weights_block` hands the products, written out."""
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            tl.store(out + rows[:, None] * K + k[None, :],
                     weights_block(codes, scales, zeros, rows, k, stride_c, stride_s, BITS, GROUP))


    @triton.jit
    def dump_ggml(codes, out, stride_c, K, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """Every weight `ggml_block` hands the products, written out."""
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            tl.store(out + rows[:, None] * K + k[None, :], ggml_block(codes, rows, k, stride_c, FMT))


@pytest.fixture(autouse=True)
def _interpreter_runs_here(request):
    """Skipped with the reason where Triton's interpreter cannot run (tests/triton_here.py), but the ones that
    compile for a GPU."""
    skip_interpreted(request)


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


PRECISIONS = ["bf16", "int8", "int4", "int2"]


def slots(precision: str, seed: int = 0, h: int = 256, i: int = 128) -> dict[str, torch.Tensor]:
    """An expert's slot tensors at `precision` on the test's device."""
    w = {k: t.bfloat16() for k, t in expert(h, i, seed).items()}
    return on(w if precision == "bf16" else quantize_expert(w, precision))


def reference(precision: str):
    """torch's ops on the same slots: the path beneath the kernels, and what they are held to."""
    if precision == "bf16":
        return DenseExpert(TorchKernels())
    return QuantizedExpert(precision, TorchKernels(), torch.bfloat16)


def triton_kernel(precision: str):
    from moetier.model.triton_experts import TritonExperts

    return TritonExperts(16 if precision == "bf16" else BITS[precision], reference(precision))


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


TOLERANCE = 1e-2 if CUDA else 5e-2  # (the interpreter truncates at every bf16 rounding)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_an_expert_computes_what_torchs_ops_do(precision, tokens):
    w = slots(precision)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 256, generator=g).bfloat16().to(DEVICE)
    weights = torch.rand(tokens, generator=g).bfloat16().to(DEVICE)
    want, got = torch.empty_like(x), torch.full_like(x, float("nan"))
    reference(precision)(want, x, w, weights)
    triton_kernel(precision)(got, x, w, weights)
    assert relative(got, want) < TOLERANCE


@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_a_layers_experts_in_one_launch_each_on_its_own_rows(precision):
    """Experts of 1, 3 and 16 rows fused, one of 19 (more than a tile) through torch's ops; rows of no expert in
    `items` stay as they were."""
    from moetier.model.triton_experts import MAX_TOKENS

    ws = [slots(precision, seed) for seed in range(4)]
    spans = [(0, 1), (1, 4), (5, 5 + MAX_TOKENS), (5 + MAX_TOKENS, 8 + 2 * MAX_TOKENS)]  # row 4 belongs to none
    p = spans[-1][1]
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(p, 256, generator=g).bfloat16().to(DEVICE)
    weights = torch.rand(p, generator=g).bfloat16().to(DEVICE)
    ys = torch.full_like(xs, -3.0)
    triton_kernel(precision).layer(ys, xs, weights, [(w, a, b) for w, (a, b) in zip(ws, spans)])
    base = reference(precision)
    for w, (a, b) in zip(ws, spans):
        want = torch.empty_like(xs[a:b])
        base(want, xs[a:b], w, weights[a:b])
        if b - a > MAX_TOKENS:
            assert torch.equal(ys[a:b], want)  # (the path beneath itself)
        else:
            assert relative(ys[a:b], want) < TOLERANCE
    assert torch.equal(ys[4], torch.full_like(ys[4], -3.0))


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("router_dtype", [torch.float32, torch.bfloat16])
def test_a_routed_token_is_computed_from_the_routers_outputs_on_the_device(precision, router_dtype):
    """`token_routed`: the experts the router's ids name (in its order, not ascending), weighted and summed — what
    torch's ops give for the same experts."""
    kernel = triton_kernel(precision)
    ws = [slots(precision, seed) for seed in range(6)]
    table = kernel.token_table(ws)
    assert table.device.shape == (6, 8) and table.bits == (16 if precision == "bf16" else 8)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 256, generator=g).bfloat16().to(DEVICE)
    topk_ids = torch.tensor([[4, 1, 5]], device=DEVICE)
    topk_weights = torch.rand(1, 3, generator=g).to(router_dtype).to(DEVICE)
    assert table.takes(x, topk_ids, topk_weights)
    got = torch.full_like(x, float("nan"))
    kernel.token_routed(got, x, topk_ids, topk_weights, table)
    want = torch.zeros(1, 256, device=DEVICE)
    for e, weight in zip(topk_ids[0].tolist(), topk_weights[0]):
        y = torch.empty_like(x)
        reference(precision)(y, x, ws[e], weight.reshape(1))
        want += y.float()
    assert relative(got, want) < TOLERANCE


@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_a_few_routed_tokens_are_each_what_it_computes_alone(precision):
    """`token_routed` of a batch's tokens (each (token, expert) pair its own row, experts shared between tokens):
    each row bit for bit what that token computes alone, and what torch's ops give. A buffer the batch outgrew is
    kept, not freed (a CUDA graph captured on it writes it at every replay)."""
    from moetier.model.triton_experts import TritonExperts

    kernel = triton_kernel(precision)
    ws = [slots(precision, seed) for seed in range(6)]
    table = kernel.token_table(ws)
    g = torch.Generator().manual_seed(4)
    t = TritonExperts.routed_tokens
    x = torch.randn(t, 256, generator=g).bfloat16().to(DEVICE)
    topk_ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(t)]).to(DEVICE)  # [T, 3]
    topk_weights = torch.rand(t, 3, generator=g).bfloat16().to(DEVICE)
    assert table.takes(x, topk_ids, topk_weights)
    kernel.token_routed(torch.empty_like(x[:1]), x[:1], topk_ids[:1], topk_weights[:1], table)
    first = kernel._h  # (what a graph of one token would have captured)
    got = torch.full_like(x, float("nan"))
    kernel.token_routed(got, x, topk_ids, topk_weights, table)
    assert kernel._h is not first and any(b is first for b in kernel._superseded)  # 24 pairs outgrew 16 rows
    for row in range(t):
        alone = torch.full_like(x[:1], float("nan"))
        kernel.token_routed(alone, x[row:row + 1], topk_ids[row:row + 1], topk_weights[row:row + 1], table)
        assert torch.equal(got[row:row + 1], alone), row
        want = torch.zeros(1, 256, device=DEVICE)
        for e, weight in zip(topk_ids[row].tolist(), topk_weights[row]):
            y = torch.empty_like(x[:1])
            reference(precision)(y, x[row:row + 1], ws[e], weight.reshape(1))
            want += y.float()
        assert relative(got[row:row + 1], want) < TOLERANCE


@pytest.mark.parametrize("precision", ["bf16", "int2"])
def test_another_tile_computes_the_same(precision):
    """Wider and deeper blocks (int2's groups of 64 inputs inside one 128-input step) give what the default does."""
    from moetier.model.triton_experts import Tiles, TritonExperts

    w = slots(precision)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 256, generator=g).bfloat16().to(DEVICE)
    weights = torch.rand(3, generator=g).bfloat16().to(DEVICE)
    got, want = torch.empty_like(x), torch.empty_like(x)
    kernel = triton_kernel(precision)
    kernel(want, x, w, weights)
    other = kernel.with_tiles(Tiles(32, 128))
    assert isinstance(other, TritonExperts) and other.tiles == Tiles(32, 128)
    other(got, x, w, weights)
    assert relative(got, want) < 1e-2
    ggml = ggml_kernel().with_tiles(Tiles(32, 128))  # (a GGUF's kernels keep their kind)
    w, want = ggml_slots(("q4_k", "q6_k")), torch.empty_like(x)
    ggml.fallback(want, x, w, weights)
    ggml(got, x, w, weights)
    assert ggml._formats(w) is not None and relative(got, want) < TOLERANCE


def test_a_tile_is_a_power_of_two_of_at_least_sixteen():
    from moetier.model.triton_experts import Tiles

    for n, k in ((8, 64), (16, 96), (48, 64)):
        with pytest.raises(ValueError, match="power of two"):
            Tiles(n, k)
    assert Tiles(32, 128).fit({"down_proj": torch.empty(256, 128), "gate_up_proj": torch.empty(256, 256)})
    assert not Tiles(32, 256).fit({"down_proj": torch.empty(256, 128), "gate_up_proj": torch.empty(256, 256)})


def test_a_gpu_computes_bf16_and_quantized_experts_with_them_and_a_prefill_through_torchs_ops():
    from moetier.model.triton_experts import MAX_TOKENS, TritonExperts

    for precision in ("bf16", "int4"):
        kernel = make_expert_kernel(precision, TritonKernels(), torch.bfloat16)
        assert isinstance(kernel, TritonExperts)
        assert not isinstance(make_expert_kernel(precision, TorchKernels(), torch.bfloat16), TritonExperts)
        assert not isinstance(make_expert_kernel(precision, CudaKernels(), torch.bfloat16), TritonExperts)
        assert not isinstance(make_expert_kernel(precision, TritonKernels(), torch.float32), TritonExperts)
        w = slots(precision)
        x = torch.randn(MAX_TOKENS + 3, 256).bfloat16().to(DEVICE)
        weights = torch.ones(MAX_TOKENS + 3, dtype=torch.bfloat16, device=DEVICE)
        got, want = torch.empty_like(x), torch.empty_like(x)
        kernel(got, x, w, weights)
        kernel.fallback(want, x, w, weights)
        assert torch.equal(got, want)  # (more tokens than the kernel's tile: torch's ops themselves)


COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moetier.model.triton_kernels import down, gate_up
ints = dict(K="i32", I="i32", stride_x="i32", stride_c="i32", stride_s="i32", stride_h="i32", stride_o="i32")
pointers = dict(x="*bf16", x_rows="*i64", table="*i64", experts="*i64", spans="*i64", h="*bf16", weights="*fp32",
                out="*bf16", alpha="fp32", limit="fp32")
swiglu = ((16, 16, 64, 0), (8, 16, 64, 0), (4, 16, 64, 0), (2, 16, 64, 0), (16, 32, 128, 0), (2, 64, 128, 0),
          *((0, 16, 64, fmt) for fmt in range(1, 10)))
clamped = ((16, 16, 64, 0, 1, 16), (4, 16, 64, 0, 1, 16), (8, 16, 64, 0, 1, 32), (0, 16, 64, 9, 1, 32),
           (0, 16, 64, 2, 1, 32))  # (gpt-oss's: bf16 and codes with bf16 or fp32 biases, a GGUF's with fp32 ones)
for bits, bn, bk, fmt, act, bias in (*(c + (0, 0) for c in swiglu), *clamped):
    for fn in (gate_up, down):
        consts = dict(BITS=bits, GROUP=128 if bits == 4 else 64, BT=16, BN=bn, BK=bk, FMT=fmt, ACT=act, BIAS=bias)
        consts = {k: v for k, v in consts.items() if k in fn.arg_names}
        sig = {name: {**ints, **pointers}.get(name, "constexpr") for name in fn.arg_names}
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        assert "cubin" in kernel.asm, (fn.__name__, bits, act)
print("compiled")
"""


def assert_compiles_for_hopper(script: str) -> None:
    """`script` (compiling kernels with triton.compile, then printing "compiled") run in a python of its own, out of
    the interpreter this module set."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


@pytest.mark.compiles
def test_the_kernels_compile_for_a_hopper_gpu_with_no_gpu_here():
    """Triton's own compiler (and the ptxas its wheel carries), not its interpreter, down to sm_90 machine code: what
    the interpreter does not check (a typed pointer from an address, constexpr branches, tuples from a jit helper)."""
    assert_compiles_for_hopper(COMPILE)


GGML = ["q8_0", "q4_k", "q5_k", "q6_k", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4"]


def blocks_of(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """[N, K] float -> uint8 [N, row bytes] in `fmt`: ours for the formats moetier makes, the gguf package's for the
    legacy ones a GGUF brings (moetier never makes those)."""
    from moetier.quant.kquants import FIT, quantize

    if fmt in FIT:
        return quantize(w, fmt)
    import gguf

    return torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[fmt.upper()]))


@pytest.mark.parametrize("fmt", GGML)
def test_the_kernels_ggml_weights_are_the_blocks_dequantized(fmt):
    """Every weight the kernel multiplies from a GGML block format: ggml_blocks.py's `dequantize`'s (the reference
    checked bit for bit against the gguf package's), in fp32 — a fused multiply-add on a GPU may differ in the last
    bit."""
    from moetier.model.triton_experts import GGML_FORMATS
    from moetier.quant.ggml_blocks import dequantize as dequantize_blocks

    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 512, generator=g) * 0.05
    w[3] *= 40  # (a row of larger weights: the scales' high bits in use)
    blocks = blocks_of(w, fmt)
    if fmt == "mxfp4":  # (exponents at the ends: the subnormal scales of 0 and 1, and 2^127)
        blocks.view(64, 16, 17)[5, :4, 0] = torch.tensor([0, 1, 2, 255], dtype=torch.uint8)
    out = torch.empty(64, 512, device=DEVICE)
    dump_ggml[(64 // 16,)](blocks.to(DEVICE), out, blocks.stride(0), 512, FMT=GGML_FORMATS[fmt], BN=16, BK=64)
    want = dequantize_blocks(blocks, fmt)
    if CUDA:
        torch.testing.assert_close(out.cpu(), want, rtol=1e-6, atol=1e-9)
    else:
        assert torch.equal(out, want)


def ggml_slots(formats: tuple[str, str], seed: int = 0, h: int = 256, i: int = 256) -> dict[str, torch.Tensor]:
    """An expert's slot tensors with gate_up_proj in formats[0] and down_proj in formats[1] (a Q4_K_M file's
    q4_k/q6_k, or q4_k/q5_0 where down_proj's rows are not whole 256-blocks), viewed as a store's slot views them,
    on the test's device."""
    from moetier.quant.precisions import matrix_shape

    w = expert(h, i, seed)
    return on({name: blocks_of(t, fmt).reshape(matrix_shape(fmt, *t.shape))
               for (name, t), fmt in zip(w.items(), formats)})


def ggml_kernel():
    from moetier.model.ggml_experts import GgmlExpert
    from moetier.model.triton_experts import TritonGgmlExperts

    return TritonGgmlExperts(GgmlExpert("q4_k_m", torch.bfloat16))


@pytest.mark.parametrize("formats", [("q4_k", "q6_k"), ("q4_k", "q4_k"), ("q5_k", "q8_0"), ("q8_0", "q6_k"),
                                     ("q4_k", "q5_0"), ("q5_k", "q5_1"), ("q4_0", "q4_1"), ("mxfp4", "mxfp4")])
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_a_ggml_expert_computes_what_torchs_ops_do(formats, tokens):
    """gate_up_proj and down_proj each in its own format, as a GGUF's experts come: what GgmlExpert computes on
    torch's ops (the blocks dequantized, fp32 products)."""
    w = ggml_slots(formats)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 256, generator=g).bfloat16().to(DEVICE)
    weights = torch.rand(tokens, generator=g).bfloat16().to(DEVICE)
    kernel = ggml_kernel()
    want, got = torch.empty_like(x), torch.full_like(x, float("nan"))
    kernel.fallback(want, x, w, weights)
    kernel(got, x, w, weights)
    assert kernel._formats(w) is not None  # (the kernels took it, not the fallback)
    assert relative(got, want) < TOLERANCE


def layer_and_routed_token(kernel, ws: list[dict], seed: int, ids: list[int]):
    """`kernel.layer` on experts `ws` of 1, 3, 16 and 19 rows (the last more than a tile: the fallback's), and
    `token_routed` through the experts `ids`, each against `kernel.fallback`; the token's table."""
    from moetier.model.triton_experts import MAX_TOKENS

    spans = [(0, 1), (1, 4), (4, 4 + MAX_TOKENS), (4 + MAX_TOKENS, 7 + 2 * MAX_TOKENS)]
    p = spans[-1][1]
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(p, 256, generator=g).bfloat16().to(DEVICE)
    weights = torch.rand(p, generator=g).bfloat16().to(DEVICE)
    ys = torch.full_like(xs, float("nan"))
    kernel.layer(ys, xs, weights, [(w, a, b) for w, (a, b) in zip(ws, spans)])
    for w, (a, b) in zip(ws, spans):
        want = torch.empty_like(xs[a:b])
        kernel.fallback(want, xs[a:b], w, weights[a:b])
        assert relative(ys[a:b], want) < TOLERANCE
    table = kernel.token_table(ws)
    topk_ids, topk_weights = torch.tensor([ids], device=DEVICE), torch.rand(1, len(ids), generator=g).to(DEVICE)
    got = torch.full_like(xs[:1], float("nan"))
    kernel.token_routed(got, xs[:1], topk_ids, topk_weights, table)
    want = torch.zeros(1, 256, device=DEVICE)
    for e, weight in zip(ids, topk_weights[0]):
        y = torch.empty_like(xs[:1])
        kernel.fallback(y, xs[:1], ws[e], weight.reshape(1))
        want += y.float()
    assert relative(got, want) < TOLERANCE
    return table


def test_a_layer_of_ggml_experts_and_a_routed_token_in_the_kernels_launches():
    layer_and_routed_token(ggml_kernel(), [ggml_slots(("q4_k", "q6_k"), seed) for seed in range(4)], 9, [2, 0, 3])


def test_a_width_the_tiles_do_not_divide_goes_through_torchs_ops():
    """An intermediate size of 96 (whole q8_0 blocks; no 64-input step divides it): the fallback itself, bit for
    bit, and no table for a routed token."""
    kernel = ggml_kernel()
    w = ggml_slots(("q8_0", "q8_0"), i=96)
    assert kernel._formats(w) is not None and kernel.token_table([w]) is None
    x = torch.randn(2, 256).bfloat16().to(DEVICE)
    weights = torch.ones(2, dtype=torch.bfloat16, device=DEVICE)
    got, want = torch.empty_like(x), torch.empty_like(x)
    kernel(got, x, w, weights)
    kernel.fallback(want, x, w, weights)
    assert torch.equal(got, want)


def test_a_gpu_computes_ggml_experts_with_the_kernels():
    from moetier.model.triton_experts import TritonGgmlExperts

    for precision in ("q4_k_m", "q4_k", "q6_k", "q8_0"):
        assert isinstance(make_expert_kernel(precision, TritonKernels(), torch.bfloat16), TritonGgmlExperts)
        assert not isinstance(make_expert_kernel(precision, CudaKernels(), torch.bfloat16),
                              TritonGgmlExperts)


@pytest.mark.skipif(CUDA, reason="the interpreter's run on the CPU; on a GPU tests/engine/test_cuda.py's")
def test_the_engine_computes_a_q4_k_m_gguf_s_experts_through_the_kernels(tmp_path, monkeypatch):
    """A GGUF's experts as a Q4_K_M file keeps them (gate and up Q4_K; down Q6_K in layer 0, Q5_0 in layer 1, as
    where a row is not whole 256-blocks) run
    by the engine through TritonGgmlExperts (here in the interpreter, on the CPU; on a GPU tests/engine/test_cuda.py)
    beside torch's ops on the same blocks: the same greedy tokens but where bf16's rounding tips one."""
    from moetier import Engine
    from moetier.config import MemoryBudget
    from moetier.engine import expert_executor
    from moetier.engine.engine import EngineConfig
    from moetier.model.triton_experts import TritonGgmlExperts
    from moetier.store.gguf_store import index_gguf
    from moetier.store.store import Store
    from tests.store import gguf_export
    from tests.tiny_models import build_tiny

    build_tiny("olmoe", tmp_path / "hf", hidden_size=256, intermediate_size=256, num_attention_heads=4,
               num_key_value_heads=4, num_layers=2)
    path = gguf_export.export(tmp_path / "hf", tmp_path / "q4_k_m.gguf", {0: ("q4_k", "q6_k"), 1: ("q4_k", "q5_0")},
                              dense_type="bf16")
    store = index_gguf(path, tmp_path / "store", progress=False)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (7, 12)]
    real = expert_executor.make_expert_kernel
    made = []

    def through_triton(precision, kernels, dtype, spec=None):
        kernel = TritonGgmlExperts(real(precision, kernels, dtype, spec))
        made.append(kernel)
        return kernel

    def run():
        config = EngineConfig(expert_memory=MemoryBudget.parse("30%"), kernels="torch")
        with Engine(Store(store), config, progress=False) as engine:
            return sum(engine.generate(prompts, max_new_tokens=8, ignore_eos=True).token_ids, [])

    want = run()
    monkeypatch.setattr(expert_executor, "make_expert_kernel", through_triton)
    got = run()
    assert made and all(k._formats_of and None not in k._formats_of.values() for k in made)  # the kernels took them
    assert sum(x == y for x, y in zip(got, want)) >= 0.8 * len(want)


ALPHA, LIMIT = 1.702, 7.0  # gpt-oss's


def clamped_slots(precision: str, seed: int = 0, h: int = 256, i: int = 256) -> dict[str, torch.Tensor]:
    """A gpt-oss expert's slot tensors at `precision` (bf16, codes, or mxfp4 blocks as its GGUF keeps them), its
    biases beside them (bf16, or fp32 as a GGUF's); weights wide enough that the clamps bite."""
    g = torch.Generator().manual_seed(seed)
    w = {"gate_up_proj": torch.randn(2 * i, h, generator=g) * 0.6, "down_proj": torch.randn(h, i, generator=g) * 0.05,
         "gate_up_proj.bias": torch.randn(2 * i, generator=g), "down_proj.bias": torch.randn(h, generator=g) * 0.1}
    if precision == "mxfp4":
        from moetier.quant.precisions import matrix_shape

        return on({name: (blocks_of(t, "mxfp4").reshape(matrix_shape("mxfp4", *t.shape)) if t.dim() == 2 else t)
                   for name, t in w.items()})
    w = {k: t.bfloat16() for k, t in w.items()}
    return on(w if precision == "bf16" else quantize_expert(w, precision))


def clamped_kernel(precision: str):
    """make_expert_kernel's for a gpt-oss model on a GPU's Triton kernels (its fallback: torch's ops)."""
    from types import SimpleNamespace

    spec = SimpleNamespace(activation="swiglu-clamped", swiglu_alpha=ALPHA, swiglu_limit=LIMIT)
    return make_expert_kernel(precision, TritonKernels(), torch.bfloat16, spec)


@pytest.mark.parametrize("precision", ["bf16", "int4", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_a_clamped_expert_with_its_biases_computes_what_torchs_ops_do(precision, tokens):
    """gpt-oss's experts: what ClampedSwigluExpert / GgmlClampedExpert compute on torch's ops, the clamps and both
    biases in (a kernel without them, or with the activation unclamped, misses by far more)."""
    from moetier.model.triton_experts import Clamp, TritonExperts

    kernel = clamped_kernel(precision)
    assert isinstance(kernel, TritonExperts) and kernel.clamp == Clamp(ALPHA, LIMIT)
    w = clamped_slots(precision)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 256, generator=g).bfloat16().to(DEVICE)
    weights = torch.rand(tokens, generator=g).bfloat16().to(DEVICE)
    want, got = torch.empty_like(x), torch.full_like(x, float("nan"))
    kernel.fallback(want, x, w, weights)
    kernel(got, x, w, weights)
    assert kernel._takes(w) and relative(got, want) < TOLERANCE
    loose = type(kernel).__new__(type(kernel))
    loose.__dict__.update(kernel.__dict__, clamp=Clamp(ALPHA, 1e4))
    loose(got, x, w, weights)
    assert relative(got, want) > 10 * TOLERANCE  # (the clamps matter here)


def test_a_layer_of_clamped_experts_and_a_routed_token_in_the_kernels_launches():
    """A GGUF's gpt-oss experts (mxfp4 blocks, fp32 biases): a layer's spans, and a token from the router's ids."""
    ws = [clamped_slots("mxfp4", seed) for seed in range(4)]
    table = layer_and_routed_token(clamped_kernel("mxfp4"), ws, 11, [3, 1])
    assert table.device.shape == (4, 8)


def test_a_clamped_expert_whose_biases_the_kernels_do_not_take_goes_through_torchs_ops():
    """Biases missing, in fp16, or the two in different dtypes: the fallback itself, bit for bit, and no table."""
    kernel = clamped_kernel("bf16")
    x = torch.randn(2, 256).bfloat16().to(DEVICE)
    weights = torch.ones(2, dtype=torch.bfloat16, device=DEVICE)
    base = clamped_slots("bf16")
    for w in ({**base, "down_proj.bias": base["down_proj.bias"].half()},
              {**base, "down_proj.bias": base["down_proj.bias"].float()}):
        assert not kernel._takes(w) and kernel.token_table([w]) is None
        got, want = torch.empty_like(x), torch.empty_like(x)
        kernel(got, x, w, weights)
        kernel.fallback(want, x, w, weights)
        assert torch.equal(got, want)
    assert not kernel._takes({k: t for k, t in base.items() if k != "gate_up_proj.bias"})


def test_switchs_relu_experts_stay_on_torchs_ops():
    from types import SimpleNamespace

    from moetier.model.triton_experts import TritonExperts

    spec = SimpleNamespace(activation="relu", swiglu_alpha=0.0, swiglu_limit=0.0)
    for precision in ("bf16", "int4"):
        assert not isinstance(make_expert_kernel(precision, TritonKernels(), torch.bfloat16, spec), TritonExperts)


@pytest.mark.skipif(CUDA, reason="the interpreter's run on the CPU; on a GPU tests/engine/test_cuda.py's")
@pytest.mark.parametrize("source", ["mxfp4-gguf", "bf16-checkpoint"])
def test_the_engine_computes_gpt_oss_experts_through_the_kernels(tmp_path, monkeypatch, tiny_store, source):
    """gpt-oss as people download it (a GGUF's MXFP4 experts and fp32 biases, read in place) and as its Hugging Face
    checkpoint's bf16 store, run by the engine through the Triton kernels with its clamped activation (in the
    interpreter here) beside torch's ops on the same experts: the same greedy tokens but where bf16's rounding tips
    one."""
    from moetier import Engine
    from moetier.config import MemoryBudget
    from moetier.engine import expert_executor
    from moetier.engine.engine import EngineConfig
    from moetier.model.triton_experts import Clamp, TritonExperts, TritonGgmlExperts
    from moetier.store.gguf_store import index_gguf
    from moetier.store.store import Store
    from tests.store import gguf_export
    from tests.tiny_models import build_tiny

    shape = dict(hidden_size=256, intermediate_size=256, swiglu_limit=7.0)
    if source == "mxfp4-gguf":
        build_tiny("gpt_oss", tmp_path / "hf", **shape)
        path = gguf_export.export(tmp_path / "hf", tmp_path / "mxfp4.gguf", {0: ("MXFP4", "MXFP4"),
                                  1: ("MXFP4", "MXFP4")}, dense_type="bf16")
        store = index_gguf(path, tmp_path / "store", progress=False)
    else:
        _, store = tiny_store("gpt_oss", dtype=torch.bfloat16, **shape)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (7, 12)]
    real = expert_executor.make_expert_kernel
    made = []

    def through_triton(precision, kernels, dtype, spec=None):
        clamp = Clamp(spec.swiglu_alpha, spec.swiglu_limit)
        kind = TritonGgmlExperts if source == "mxfp4-gguf" else lambda k, clamp: TritonExperts(16, k, clamp=clamp)
        made.append(kind(real(precision, kernels, dtype, spec), clamp=clamp))
        return made[-1]

    def run():
        config = EngineConfig(expert_memory=MemoryBudget.parse("40%"), kernels="torch")
        with Engine(Store(store), config, progress=False) as engine:
            return sum(engine.generate(prompts, max_new_tokens=8, ignore_eos=True).token_ids, [])

    want = run()
    taken = []
    monkeypatch.setattr(expert_executor, "make_expert_kernel", through_triton)
    monkeypatch.setattr(TritonExperts, "_launch", lambda self, *args, real=TritonExperts._launch: (
        taken.append(len(args[3])), real(self, *args))[1])
    got = run()
    assert made and sum(taken) > 0  # (the kernels computed experts, not the fallback)
    assert sum(x == y for x, y in zip(got, want)) >= 0.8 * len(want)
