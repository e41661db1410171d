"""A store's experts in GGML's block formats (q8_0, q6_k, q5_k, q4_k: `moetier quantize --precisions q4_k`): laid
out as a GGUF holds an expert's slice, computed by the GGML kernels, read and counted as any other copy — and
closer to the exact weights than our own int4 at the same size."""

import shutil

import pytest
import torch

from moetier import Engine
from moetier.config import MemoryBudget
from moetier.engine.engine import EngineConfig
from moetier.errors import StoreError
from moetier.model import native
from moetier.model.expert_kernels import QuantizedExpert, make_expert_kernel
from moetier.model.ggml_experts import GgmlClampedExpert, GgmlExpert
from moetier.model.kernels import TorchKernels
from moetier.plan.precision import MixedPrecision
from moetier.quant.ggml_blocks import dequantize
from moetier.quant.precisions import quantize_expert
from moetier.store.format import Manifest
from moetier.store.store import Store
from moetier.store.variants import add_precisions

WIDE = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2)  # rows of whole 256-weight blocks


@pytest.fixture(scope="module")
def blocks(tiny_store, tmp_path_factory):
    _, path = tiny_store("olmoe", dtype=torch.bfloat16, **WIDE)
    dest = tmp_path_factory.mktemp("blocks") / "store"
    shutil.copytree(path, dest)
    add_precisions(dest, "q8_0,q4_k,int4", progress=False)
    return dest


def run(path, mode, memory="100%"):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (7, 12)]
    config = EngineConfig(expert_memory=MemoryBudget.parse(memory), precision=MixedPrecision(mode))
    with Engine(Store(path), config) as engine:
        outs = [engine.generate([p], max_new_tokens=10, ignore_eos=True) for p in prompts]
    return [o.token_ids[0] for o in outs], [o.stats for o in outs]


def test_the_layout_is_a_gguf_experts_slice(blocks):
    layout = Manifest.load(blocks).precisions["q4_k"]
    gate_up, down = layout.tensors
    assert (gate_up.dtype, gate_up.shape) == ("q4_k", (512, 144)) and (down.dtype, down.shape) == ("q4_k", (256, 144))


def test_a_narrow_matrix_takes_q8_0_and_one_not_in_blocks_of_32_is_refused(tiny_store, tmp_path):
    _, path = tiny_store("olmoe", dtype=torch.bfloat16, num_hidden_layers=2, intermediate_size=64)  # hidden 64
    shutil.copytree(path, tmp_path / "store")
    add_precisions(tmp_path / "store", "q4_k", progress=False)
    assert {t.dtype for t in Manifest.load(tmp_path / "store").precisions["q4_k"].tensors} == {"q8_0"}
    tokens, _ = run(tmp_path / "store", "q4_k")
    assert all(len(t) == 10 for t in tokens)
    _, odd = tiny_store("olmoe", dtype=torch.bfloat16, num_hidden_layers=2)  # intermediate 48
    with pytest.raises(StoreError, match="whole blocks of 256 .or of 32, in q8_0.; got 48"):
        add_precisions(odd, "q4_k", progress=False)
    with pytest.raises(StoreError, match="mxfp4 needs in_features in whole blocks of 32; got 48"):
        add_precisions(odd, "mxfp4", progress=False)


@pytest.mark.parametrize("mode", ["q8_0", "q4_k"])
def test_a_block_copy_runs_and_reads_its_own_bytes(blocks, mode):
    tokens, stats = run(blocks, mode, memory="40%")
    blob = Manifest.load(blocks).precisions[mode].blob_bytes
    for s in stats:
        assert s["expert_bytes_read"] == (s["prefill"]["loads"] + s["decode"]["loads"]) * blob
    assert all(len(t) == 10 for t in tokens)
    if mode == "q8_0":  # (q4_k's greedy tokens on random weights part early: its closeness is the kernel test's)
        exact = sum(run(blocks, "native")[0], [])
        assert sum(a == b for a, b in zip(exact, sum(tokens, []))) / len(exact) >= 0.8


@pytest.mark.parametrize("lib", [None, "native"])
def test_the_expert_kernel_is_the_dequantized_expert(lib):
    if lib == "native" and native.load().lib is None:
        pytest.skip(native.load().reason)
    g = torch.Generator().manual_seed(0)
    floats = {"gate_up_proj": torch.randn(512, 256, generator=g) * 0.05,
              "down_proj": torch.randn(256, 256, generator=g) * 0.05}
    w = quantize_expert(floats, "q4_k")
    kernel = GgmlExpert("q4_k", torch.bfloat16, native.load().lib if lib else None)
    x = torch.randn(3, 256, generator=g).bfloat16()
    weights = torch.tensor([1.0, 0.5, 0.25]).bfloat16()
    out = torch.empty(3, 256, dtype=torch.bfloat16)
    kernel(out, x, w, weights)
    gate, up = (x.float() @ dequantize(w["gate_up_proj"], "q4_k").T).chunk(2, dim=1)
    want = (torch.nn.functional.silu(gate) * up) @ dequantize(w["down_proj"], "q4_k").T * weights.float()[:, None]
    assert ((out.float() - want).norm() / want.norm()).item() < 0.03


def test_q4_k_is_closer_to_the_exact_expert_than_int4():
    g = torch.Generator().manual_seed(1)
    floats = {"gate_up_proj": torch.randn(512, 256, generator=g) * 0.05,
              "down_proj": torch.randn(256, 256, generator=g) * 0.05}
    x = torch.randn(16, 256, generator=g).bfloat16()
    weights = torch.ones(16).bfloat16()

    def expert(kernel, w):
        out = torch.empty(16, 256, dtype=torch.bfloat16)
        kernel(out, x, w, weights)
        return out.float()

    kernels = TorchKernels()
    exact = expert(make_expert_kernel("bf16", kernels, torch.bfloat16), {k: v.bfloat16() for k, v in floats.items()})
    err = {p: (expert(make_expert_kernel(p, kernels, torch.bfloat16), quantize_expert(floats, p)) - exact).norm()
           for p in ("q4_k", "int4")}
    assert isinstance(make_expert_kernel("int4", kernels, torch.bfloat16), QuantizedExpert)
    assert err["q4_k"] < 0.8 * err["int4"]


def test_gpt_oss_experts_take_block_copies_with_their_biases_in_float32(tiny_store, tmp_path):
    """gpt-oss's clamped SwiGLU experts from a Hugging Face folder take block copies as SwiGLU experts do, their
    biases beside the blocks in float32 as its GGUFs keep them — so GgmlClampedExpert computes a token's experts in
    its one native call — and a run from the copies follows the bf16 experts' greedy tokens."""
    _, path = tiny_store("gpt_oss", dtype=torch.bfloat16, hidden_size=256, intermediate_size=256,
                         num_hidden_layers=2)
    shutil.copytree(path, tmp_path / "store")
    add_precisions(tmp_path / "store", "q8_0,q4_k_m", progress=False)
    store = Store(tmp_path / "store")
    layout = store.manifest.precisions["q8_0"]
    assert {t.name: t.dtype for t in layout.tensors} == {"gate_up_proj": "q8_0", "gate_up_proj.bias": "float32",
                                                         "down_proj": "q8_0", "down_proj.bias": "float32"}
    floats, copy = store.read_expert(1, 3), store.read_expert(1, 3, "q8_0")
    for name in ("gate_up_proj.bias", "down_proj.bias"):
        assert torch.equal(copy[name], floats[name].float())
    kernel = make_expert_kernel("q8_0", TorchKernels(), torch.bfloat16, store.spec)
    assert isinstance(kernel, GgmlClampedExpert)
    if native.load().lib is not None:  # (the one call's table: made only for float32 biases)
        assert GgmlClampedExpert("q8_0", torch.bfloat16, 1.702, 7.0, native.load().lib).token_table([copy])
    exact, tokens = sum(run(tmp_path / "store", "native")[0], []), sum(run(tmp_path / "store", "q8_0", "40%")[0], [])
    assert sum(a == b for a, b in zip(exact, tokens)) / len(exact) >= 0.8
    assert all(len(t) == 10 for t in run(tmp_path / "store", "q4_k_m")[0])


def test_experts_that_are_not_swiglu_are_refused_before_anything_is_written(tiny_store, tmp_path):
    _, path = tiny_store("switch_transformers", dtype=torch.bfloat16)
    shutil.copytree(path, tmp_path / "store")
    before = sorted(p.name for p in (tmp_path / "store").iterdir())
    with pytest.raises(StoreError, match="q4_k copies are for SwiGLU experts .gpt-oss's clamped ones too.; this "
                                         "model's are relu"):
        add_precisions(tmp_path / "store", "q4_k", progress=False)
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == before


def test_a_q4_k_m_copy_widens_the_down_proj_of_llama_cpps_layers(tiny_store, tmp_path):
    """`--precisions q4_k_m`: Q4_K, with down_proj in Q6_K in the layers llama.cpp's use_more_bits picks (of 8: the
    first, the last and every third between: 0, 3, 6, 7), each expert's bytes ggml's quantizer's, and a run computes
    from them through a cache of two slots (which hold both layouts in turn)."""
    from moetier.quant.kquants import quantize
    from moetier.quant.precisions import use_more_bits

    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]  # OLMoE's Q4_K_M file
    _, path = tiny_store("olmoe", dtype=torch.bfloat16, **dict(WIDE, num_hidden_layers=8))
    shutil.copytree(path, tmp_path / "store")
    add_precisions(tmp_path / "store", "q4_k_m", progress=False)
    store = Store(tmp_path / "store")
    layout = store.manifest.precisions["q4_k_m"]
    wide = [layer for layer in range(8) if layout.formats(layer)["down_proj"] == "q6_k"]
    assert wide == [0, 3, 6, 7] and all(layout.formats(layer)["gate_up_proj"] == "q4_k" for layer in range(8))
    for layer in (3, 4):
        floats, copy = store.read_expert(layer, 2), store.read_expert(layer, 2, "q4_k_m")
        fmt = "q6_k" if layer in wide else "q4_k"
        assert torch.equal(copy["down_proj"], quantize(floats["down_proj"].float(), fmt))
    tokens, stats = run(tmp_path / "store", "q4_k_m", f"{2 * layout.blob_bytes}B")
    assert all(len(t) == 10 for t in tokens) and stats[0]["hit_rate"] < 1
