"""A step's RMSNorms and rotations in Triton (moetier/model/triton_dense.py, TritonKernels): on a GPU where there is
one; else, where triton is installed, in its interpreter on the CPU (the kernels round on the bits, so the
interpreter rounds as the GPU does and the checks are the same). Skipped where triton is not installed (CI); on the
CPU, but for the compile test, where its interpreter cannot run (tests/triton_here.py)."""

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

from moetier.config import RopeSpec  # noqa: E402
from moetier.model.batch import StepBatch  # noqa: E402
from moetier.model.kernels import TorchKernels  # noqa: E402
from moetier.model.layers import rms_norm  # noqa: E402
from moetier.model.rope import Rope  # noqa: E402
from tests.model.test_kernels import ulps_apart  # noqa: E402
from tests.model.test_triton_experts import assert_compiles_for_hopper  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter_runs_here(request):
    """Skipped with the reason where Triton's interpreter cannot run (tests/triton_here.py), but the ones that
    compile for a GPU."""
    skip_interpreted(request)


def kernels():
    from moetier.model.kernels import TritonKernels

    return TritonKernels()


@pytest.mark.parametrize("shape", [(1, 2048), (5, 64), (3, 4, 128), (2, 7168), (1, 100)])
def test_a_norm_is_transformers_rounded_as_it_rounds_but_for_the_order_of_its_sum(shape):
    """Rows of any width (a power of two or not, DeepSeek-V3's 7,168) and leading shape (per-head q/k norms): each
    value torch's ops' or, where the sum of squares in another order tips a rounding, one bf16 step from it."""
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).bfloat16().to(DEVICE)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).bfloat16().to(DEVICE)
    got, want = kernels().rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    apart = ulps_apart(got, want)
    assert apart.max() <= 1 and (apart == 0).float().mean() >= 0.99


def test_a_norm_of_rows_that_round_alike_is_bit_for_bit():
    """Rows whose sum of squares is exact in any order (small integers): nothing left to tip, every value torch's."""
    x = torch.tensor([[1.0, -2.0, 3.0, 0.0] * 16, [4.0] * 64]).bfloat16().to(DEVICE)
    w = torch.linspace(0.5, 1.5, 64).bfloat16().to(DEVICE)
    assert torch.equal(kernels().rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("shape", [(1, 2048), (6, 100)])
def test_a_residual_add_and_the_norm_after_it_are_torchs_in_one_launch(shape):
    """The sum torch's bf16 add bit for bit, its norm what `rms_norm` makes of that sum; h left as it was."""
    g = torch.Generator().manual_seed(shape[1])
    h, delta = ((torch.randn(*shape, generator=g) * 2).bfloat16().to(DEVICE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).bfloat16().to(DEVICE)
    before = h.clone()
    summed, normed = kernels().add_rms_norm(h, delta, w, 1e-6)
    assert torch.equal(summed, h + delta) and torch.equal(h, before)
    assert torch.equal(normed, kernels().rms_norm(summed, w, 1e-6))
    assert ulps_apart(normed, rms_norm(h + delta, w, 1e-6)).max() <= 1


@pytest.mark.parametrize("shape", [(1, 2880), (5, 64), (3, 4, 64), (2, 100)])
def test_gpt_oss_s_norm_applies_its_weight_in_fp32_and_rounds_once(shape):
    """gpt-oss's RMSNorm (rms_norm_fp32_weight: the weight times the fp32 normed row, one rounding), alone and after
    a residual add, each value torch's ops' or one bf16 step from it where the order of the sum tips a rounding —
    and not transformers' other norm, which rounds before the weight."""
    from moetier.model.layers import rms_norm_fp32_weight

    g = torch.Generator().manual_seed(sum(shape))
    x, delta = ((torch.randn(*shape, generator=g) * 3).bfloat16().to(DEVICE) for _ in range(2))
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).bfloat16().to(DEVICE)
    got, want = kernels().rms_norm_fp32_weight(x, w, 1e-5), rms_norm_fp32_weight(x, w, 1e-5)
    apart = ulps_apart(got, want)
    assert got.shape == want.shape and apart.max() <= 1 and (apart == 0).float().mean() >= 0.99
    assert (ulps_apart(got, rms_norm(x, w, 1e-5)) > 0).any()  # (the two norms differ on these values)
    if x.dim() == 2:
        summed, normed = kernels().add_rms_norm_fp32_weight(x, delta, w, 1e-5)
        assert torch.equal(summed, x + delta) and torch.equal(normed, kernels().rms_norm_fp32_weight(summed, w, 1e-5))


def rope_of(dim: int | None, head_dim: int, interleaved: bool = False):
    spec = RopeSpec(theta=10000.0, dim=dim or 0, interleaved=interleaved)
    return Rope(spec, head_dim, 64, torch.bfloat16, DEVICE).short


@pytest.mark.parametrize("dim,head_dim,heads,interleaved", [(None, 128, 4, False), (None, 64, 3, False),
                                                             (32, 80, 2, False), (None, 96, 1, False),
                                                             (None, 64, 16, True), (None, 8, 1, True),
                                                             (32, 48, 2, True)])
def test_a_rotation_is_torchs_bit_for_bit(dim, head_dim, heads, interleaved):
    """Whole heads and partial ones (the dimensions past `dim` copied), at each token's own position; a head width
    that is not a power of two; pairs interleaved (DeepSeek's: MLA's 64 rotated dimensions of 16 heads, its one
    shared key head)."""
    tables = rope_of(dim, head_dim, interleaved)
    g = torch.Generator().manual_seed(head_dim)
    x = (torch.randn(5, heads, head_dim, generator=g) * 4).bfloat16().to(DEVICE)
    batch = StepBatch.decode_step([1] * 5, list(range(5)), [0, 3, 17, 40, 63], 5, device=DEVICE)
    got = kernels().rope(tables, x, batch)
    assert torch.equal(got, TorchKernels().rope(tables, x, batch))
    assert not torch.equal(got, x)


def test_a_norm_takes_rows_of_a_wider_tensor_as_they_lie():
    """MLA's latent: the first columns of a wider product, each row contiguous, normed without a copy — as torch's
    ops norm the same values copied out."""
    from moetier.model import triton_dense

    g = torch.Generator().manual_seed(3)
    compressed = torch.randn(4, 96, generator=g).bfloat16().to(DEVICE)
    latent = compressed[:, :64]
    w = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    assert triton_dense.takes_norm_of(latent) and not latent.is_contiguous()
    got = kernels().rms_norm(latent, w, 1e-6)
    assert got.is_contiguous() and ulps_apart(got, rms_norm(latent.contiguous(), w, 1e-6)).max() <= 1
    assert torch.equal(got, kernels().rms_norm(latent.contiguous(), w, 1e-6))


def test_keys_and_values_land_where_index_put_puts_them_and_nowhere_else():
    """A prefill's tokens of two rows and a decode step's rows out of order: both caches byte for byte what torch's
    index_put_ leaves, in one launch."""
    from moetier.model.kv_cache import KVCache

    spec = type("Spec", (), dict(latent_attention=None, encoder_decoder=None, num_kv_heads=3, head_dim=40,
                                 num_layers=2))
    g = torch.Generator().manual_seed(4)
    caches = [KVCache(spec, 3, 16, torch.bfloat16, DEVICE) for _ in range(2)]
    for c in caches:  # (something there already: a write must leave the rest alone)
        for t in (*c.k, *c.v):
            t.copy_(torch.randn(t.shape, generator=g).bfloat16())
    caches[1].k[1].copy_(caches[0].k[1]), caches[1].v[1].copy_(caches[0].v[1])
    prefill = StepBatch.decode_step([1] * 5, [0, 0, 0, 2, 2], [0, 1, 2, 7, 8], 3, device=DEVICE)
    decode = StepBatch.decode_step([1, 1], [2, 0], [9, 3], 3, device=DEVICE)
    for batch in (prefill, decode):
        n = len(batch.rows_host)
        k, v = (torch.randn(n, 3, 40, generator=g).bfloat16().to(DEVICE) for _ in range(2))
        kernels().kv_write(caches[0], 1, batch, k, v)
        TorchKernels().kv_write(caches[1], 1, batch, k, v)
    assert torch.equal(caches[0].k[1], caches[1].k[1]) and torch.equal(caches[0].v[1], caches[1].v[1])


def test_what_the_kernels_do_not_take_goes_to_torchs_ops(monkeypatch):
    """fp32 (the parity tests' models), rows that are not contiguous, a rotation or a cache write of a strided view:
    torch's ops (the kernels made to fail, so that a call reaching them shows)."""
    from moetier.model import triton_dense

    def never(*args):
        raise AssertionError("a Triton kernel was asked")

    triton_kernels, torch_kernels = kernels(), TorchKernels()
    monkeypatch.setattr(triton_dense, "rms_norm", never)
    monkeypatch.setattr(triton_dense, "rope", never)
    monkeypatch.setattr(triton_dense, "kv_write", never)
    monkeypatch.setattr(triton_dense, "add_rms_norm", never)
    g = torch.Generator().manual_seed(1)
    x32 = torch.randn(3, 64, generator=g).to(DEVICE)
    w32 = torch.ones(64, device=DEVICE)
    assert torch.equal(triton_kernels.rms_norm(x32, w32, 1e-6), rms_norm(x32, w32, 1e-6))
    summed, normed = triton_kernels.add_rms_norm(x32, x32, w32, 1e-6)
    assert torch.equal(summed, x32 + x32) and torch.equal(normed, rms_norm(x32 + x32, w32, 1e-6))
    wide = torch.randn(3, 128, generator=g).bfloat16().to(DEVICE)
    view = wide[:, ::2]
    w = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(triton_kernels.rms_norm(view, w, 1e-6), rms_norm(view, w, 1e-6))
    batch = StepBatch.decode_step([1, 1], [0, 1], [2, 9], 2, device=DEVICE)
    x = torch.randn(2, 2, 128, generator=g).bfloat16().to(DEVICE)[..., ::2]
    tables = rope_of(None, 64)
    assert torch.equal(triton_kernels.rope(tables, x, batch), torch_kernels.rope(tables, x, batch))
    from moetier.model.kv_cache import KVCache

    spec = type("Spec", (), dict(latent_attention=None, encoder_decoder=None, num_kv_heads=2, head_dim=64,
                                 num_layers=1))
    for dtype in (torch.float32, torch.bfloat16):  # fp32; and bf16 keys from a strided view
        kv, want = KVCache(spec, 2, 16, dtype, DEVICE), KVCache(spec, 2, 16, dtype, DEVICE)
        k = x.to(dtype) if dtype == torch.float32 else x
        v = torch.randn(2, 2, 64, generator=g).to(dtype).to(DEVICE)
        triton_kernels.kv_write(kv, 0, batch, k, v)
        torch_kernels.kv_write(want, 0, batch, k, v)
        assert torch.equal(kv.k[0], want.k[0]) and torch.equal(kv.v[0], want.v[0])


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3", "gpt_oss"])
def test_the_engine_runs_a_bf16_model_with_them(tiny_store, monkeypatch, family):
    """OLMoE (its q and k norms over all heads too), DeepSeek-V3 (MLA: the latent's norm on a slice, pairs rotated
    interleaved) and gpt-oss (YaRN, attention sinks, sliding windows) decoding with TritonKernels' norms and
    rotations beside torch's ops: the same greedy tokens but where a norm's sum of squares tips a rounding. On a GPU
    the engine runs there (`kernels="auto"`, what a user gets); on the CPU, TritonKernels stood in for the CPU's
    (the interpreter's pointers are host memory)."""
    from moetier import Engine
    from moetier.config import MemoryBudget
    from moetier.engine import engine as engine_module
    from moetier.engine.engine import EngineConfig
    from moetier.model import triton_dense
    from moetier.model.kernels import TritonKernels
    from moetier.store.store import Store

    _, path = tiny_store(family, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (6, 9)]

    def run(kernels="torch"):
        config = EngineConfig(expert_memory=MemoryBudget.parse("50%"), kernels=kernels, device=DEVICE)
        with Engine(Store(path), config, progress=False) as engine:
            return sum(engine.generate(prompts, max_new_tokens=8, ignore_eos=True).token_ids, [])

    want = run()
    calls = {"rms_norm": 0, "add_rms_norm": 0, "rope": 0, "kv_write": 0}
    for name in calls:
        real = getattr(triton_dense, name)

        def counted(*args, real=real, name=name, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(triton_dense, name, counted)

    class OnTheCpu(TritonKernels):
        def decode_attention(self, *args):  # (the GPU's backends list is for CUDA's SDPA)
            return TorchKernels.decode_attention(self, *args)

    if CUDA:  # (on the 2026-11-30 H200 this test ran the engine on the CPU and handed Triton host memory)
        got = run("auto")
    else:
        monkeypatch.setattr(engine_module, "make_kernels", lambda *args: OnTheCpu())
        got = run()
    assert all(n > 0 for name, n in calls.items() if name != "kv_write" or family == "olmoe"), calls  # (MLA: its own)
    assert sum(x == y for x, y in zip(got, want)) >= 0.9 * len(want)


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moetier.model.triton_dense import add_rms_norm_kernel, kv_write_kernel, rms_norm_kernel, rope_kernel
signature = dict(x="*bf16", weight="*bf16", out="*bf16", h="*bf16", delta="*bf16", summed="*bf16", stride_x="i32",
                 H="i32", eps="fp32", positions="*i64", cos="*bf16", sin="*bf16", heads="i32", D="i32", dim="i32",
                 k="*bf16", v="*bf16", keys="*bf16", values="*bf16", rows="*i64", max_len="i32")
for fn, consts in ((rms_norm_kernel, dict(BH=2048, FP32_WEIGHT=False)), (rms_norm_kernel, dict(BH=8192,
                   FP32_WEIGHT=False)), (add_rms_norm_kernel, dict(BH=2048, FP32_WEIGHT=False)),
                   (rms_norm_kernel, dict(BH=4096, FP32_WEIGHT=True)), (add_rms_norm_kernel, dict(BH=4096,
                   FP32_WEIGHT=True)),
                   (rope_kernel, dict(BHALF=64, BTAIL=0, INTERLEAVED=False)),
                   (rope_kernel, dict(BHALF=16, BTAIL=64, INTERLEAVED=False)),
                   (rope_kernel, dict(BHALF=32, BTAIL=0, INTERLEAVED=True)), (kv_write_kernel, dict(BD=128))):
    sig = {name: signature.get(name, "constexpr") for name in fn.arg_names}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
    assert "cubin" in kernel.asm, fn.__name__
print("compiled")
"""


@pytest.mark.compiles
def test_the_kernels_compile_for_a_hopper_gpu_with_no_gpu_here():
    """Triton's own compiler down to sm_90 machine code (what the interpreter does not check: the bit casts)."""
    assert_compiles_for_hopper(COMPILE)
