"""Dense weights at a quantized precision (--dense-precision): the attention projections and the head replaced by
int8/int4 copies at load, computed from their codes (native, up to 4 rows) or dequantized (more rows, or torch),
their bytes known before loading, refused where the attention is not grouped-query."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from moetier.config import MemoryBudget
from moetier.engine.engine import Engine, EngineConfig
from moetier.errors import MoetierError
from moetier.model import native
from moetier.model.dense_quant import (
    QuantizedDenseKernels,
    QuantizedMatrix,
    dense_bytes,
    quantize_dense,
    quantize_matrix,
    quantized_dense_bytes,
)
from moetier.model.expert_kernels import TOKENS_A_CALL
from moetier.model.gemm_precision import integer_tokens
from moetier.model.kernels import TorchKernels, make_kernels
from moetier.quant.codes import dequantize
from moetier.store.store import Store
from tests.model.isas import isa_params

ISAS = isa_params()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 40])
def test_a_quantized_linear_computes_its_dequantized_matrix(isa, precision, rows):
    """Up to gemm_precision.integer_tokens rows (beside a fast bf16 GEMM) from the codes by integer dot products (the
    activations' int8 rounding: ~1% of the output), more rows through the matrix dequantized once (exactly the
    reference)."""
    from moetier.model.kernels import NativeKernels

    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(384, 512, generator=g) / 512 ** 0.5).bfloat16()
    m = quantize_matrix(w, precision)
    x = torch.randn(rows, 512, generator=g).bfloat16()
    kernels = QuantizedDenseKernels(NativeKernels(native.load(isa).lib, isa), bf16_gemm=True)
    out = kernels.linear(x, m)
    ref = F.linear(x, dequantize(m.q))
    gemm = rows > integer_tokens(precision, True)
    if gemm:
        assert torch.equal(out, ref)
    else:
        err = (out.float() - ref.float()).abs()
        assert err.mean() < 0.02 * ref.float().abs().mean() and err.max() < 0.06 * ref.float().abs().max()
    bias = torch.randn(384, generator=g).bfloat16()
    with_bias = F.linear(x, dequantize(m.q), bias) if gemm else out + bias
    assert torch.equal(kernels.linear(x, m, bias), with_bias)
    plain = torch.randn(5, 512).bfloat16()  # an unquantized weight goes to the base kernels
    assert torch.equal(kernels.linear(x, plain[:, :512]), NativeKernels(native.load(isa).lib).linear(x, plain))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_a_prompt_without_bf16_dot_products_is_the_kernels_passes_bit_for_bit(isa, precision):
    """Where torch's bf16 GEMM is slow (moetier/model/gemm_precision.py) a prompt's rows go through the integer
    kernels, 4 a pass, each row read once for a call's rows (TOKENS_A_CALL: more make calls of that many): what each
    pass computes alone, bit for bit, at every remainder."""
    from moetier.model.kernels import NativeKernels

    g = torch.Generator().manual_seed(11)  # (200 rows: ragged tiles of rows, csrc/q_int.c tile_rows)
    m = quantize_matrix((torch.randn(200, 512, generator=g) / 512 ** 0.5).bfloat16(), precision)
    kernels = QuantizedDenseKernels(NativeKernels(native.load(isa).lib, isa), bf16_gemm=False)
    for rows in (5, 8, 11, TOKENS_A_CALL + 5):
        x = torch.randn(rows, 512, generator=g).bfloat16()
        passes = torch.cat([kernels.linear(x[a:a + 4], m) for a in range(0, rows, 4)])
        assert torch.equal(kernels.linear(x, m), passes)
        assert not torch.equal(passes, F.linear(x, dequantize(m.q)))  # (not the dequantized GEMM's)


def test_without_the_native_library_a_quantized_linear_is_the_reference():
    w = torch.randn(96, 64)
    m = quantize_matrix(w, "int4")
    x = torch.randn(2, 64)
    assert torch.equal(QuantizedDenseKernels(TorchKernels()).linear(x, m), F.linear(x, dequantize(m.q, torch.float32)))


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
@pytest.mark.parametrize("precision", ["native", "int8", "int4"])
def test_the_dense_bytes_are_known_before_loading(tiny_store, family, precision):
    _, path = tiny_store(family)
    store = Store(path)
    dense = quantize_dense(store.load_dense(), store.spec, precision)
    assert quantized_dense_bytes(store.dense_tensors(), precision) == dense_bytes(dense)
    quantized = [n for n, t in dense.items() if isinstance(t, QuantizedMatrix)]
    if precision == "native":
        assert not quantized
    else:  # every layer's four projections, and the head (tied or not)
        assert len(quantized) == 4 * store.spec.num_layers + 1 and "lm_head" in quantized
        assert dense_bytes(dense) < store.dense_bytes


def kl_against_exact(path, precision: str, check, generate: bool = False):
    """Teacher-forced through prefill and decode steps, exact mode and `--dense-precision precision` on the store at
    `path` (every expert resident): KL(exact || it) per position, and its 4 greedy tokens if `generate`. `check(engine)`
    asserts on the quantized engine while it is open."""
    from moetier.engine.score import teacher_forced

    ids = [5, 9, 2, 33, 17, 4, 8, 61, 22, 7, 90, 3]
    everything = MemoryBudget("share", 1.0)
    with Engine(Store(path), EngineConfig(expert_memory=everything), progress=False) as exact:
        want, _ = teacher_forced(exact, ids, 4)
    with Engine(Store(path), EngineConfig(expert_memory=everything, dense_precision=precision),
                progress=False) as engine:
        check(engine)
        got, _ = teacher_forced(engine, ids, 4)
        tokens = engine.generate([ids], max_new_tokens=4, ignore_eos=True).token_ids if generate else None
    return (want.exp() * (want - got)).sum(-1), tokens  # [positions]


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_an_engine_with_quantized_dense_weights_scores_near_exact(tiny_store, precision):
    """bf16 OLMoE, teacher-forced through prefill and decode steps: each next-token distribution near exact mode's
    (KL below 0.01 at int8, 0.1 at int4; a misread scale or code gives KL of order one), and the budget counts the
    quantized dense bytes."""
    _, path = tiny_store("olmoe", dtype=torch.bfloat16)

    def check(engine):
        assert isinstance(engine.model.lm_head, QuantizedMatrix)
        assert engine.budget.dense_bytes == engine.dense_bytes < Store(path).dense_bytes

    kl, tokens = kl_against_exact(path, precision, check, generate=True)
    assert kl.max() < {"int8": 0.01, "int4": 0.1}[precision] and kl.max() > 0
    assert len(tokens[0]) == 4


def test_latent_attention_is_refused_before_loading(tiny_store):
    _, path = tiny_store("deepseek_v3")
    with pytest.raises(MoetierError, match="quantizes grouped-query attention"):
        Engine(Store(path), EngineConfig(dense_precision="int4"), progress=False)


def test_the_option_is_checked_in_one_line():
    r = subprocess.run([sys.executable, "-m", "moetier.cli", "generate", "--dense-precision", "int2", "--prompt", "x"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("moetier: error: argument --dense-precision")
    with pytest.raises(MoetierError, match="unknown dense precision"):
        EngineConfig(dense_precision="fp8")


def test_auto_kernels_are_wrapped_only_when_asked():
    base = make_kernels("torch", torch.bfloat16, "cpu")
    from moetier.model.dense_quant import with_dense_precision

    assert with_dense_precision(base, "native") is base
    assert isinstance(with_dense_precision(base, "int4"), QuantizedDenseKernels)


def test_a_q4_k_m_dense_precision_follows_llama_cpps_mix():
    """q/k/o Q4_K, v Q6_K in use_more_bits' layers (of 12, as demo-deep's Q4_K_M file has them: 0, 3, 6, 9, 10,
    11), the head Q6_K; q8_0 for the q8_0 precision and where rows are not whole 256-blocks."""
    from moetier.model.dense_quant import block_format, quantize_block_matrix

    v = [i for i in range(12) if block_format(f"layers.{i}.v_proj", "q4_k_m", 12) == "q6_k"]
    assert v == [0, 3, 6, 9, 10, 11]
    assert {block_format(f"layers.3.{p}_proj", "q4_k_m", 12) for p in "qko"} == {"q4_k"}
    assert block_format("lm_head", "q4_k_m", 12) == "q6_k" and block_format("layers.3.q_proj", "q8_0", 12) == "q8_0"
    assert quantize_block_matrix(torch.randn(8, 64), "q4_k").fmt == "q8_0"  # 64 wide: no whole 256-block


@pytest.mark.parametrize("precision", ["q8_0", "q4_k_m"])
def test_an_engine_with_ggml_dense_weights_scores_near_exact(tiny_store, precision):
    """bf16 OLMoE 256 wide (whole k-quant blocks): its projections and head as GGML blocks (BlockMatrix), their
    bytes known before loading, each next-token distribution near exact mode's (a misread block: KL of order one)."""
    from moetier.model.dense_quant import BlockMatrix

    _, path = tiny_store("olmoe", dtype=torch.bfloat16, hidden_size=256, intermediate_size=256, num_hidden_layers=2)

    def check(engine):
        head = engine.model.w["lm_head"]
        assert isinstance(head, BlockMatrix) and head.fmt == {"q8_0": "q8_0", "q4_k_m": "q6_k"}[precision]
        assert engine.budget.dense_bytes >= engine.dense_bytes and engine.dense_bytes < Store(path).dense_bytes

    kl, _ = kl_against_exact(path, precision, check)
    assert 0 < kl.max() < {"q8_0": 0.01, "q4_k_m": 0.1}[precision]
