"""GGUF files run in place: the same model as its Hugging Face folder (logits to the parity tests' tolerance, greedy
tokens equal transformers'), its experts read from the file in its own types — a Q4_K_M-like file's layers in
different ones —, nothing copied, and every file that cannot be read, changed or rotted refused."""

import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from moetier import Engine
from moetier.cli import main
from moetier.config import MemoryBudget
from moetier.engine.engine import EngineConfig
from moetier.engine.stats import GenerationStats
from moetier.errors import ChecksumError, StoreError
from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.model_info import inspect_model
from moetier.plan.route import DECODE, PREFILL
from moetier.resolve import resolve_model
from moetier.store.format import Manifest
from moetier.store.gguf_file import GgufError, GgufModel
from moetier.store.gguf_store import index_gguf
from moetier.store.store import Store
from tests.model.test_parity import ATOL, engine_with_slots, reference_run
from tests.store import gguf_export, gguf_writer
from tests.store.test_gguf_file import DEMO as DEMO_DIR
from tests.tiny_models import FAMILY_CONFIGS, build_tiny


def engine(path, slots: int | None = None, kernels: str = "auto") -> Engine:
    store = Store(path)
    slots = slots or store.spec.num_expert_keys
    return Engine(store, EngineConfig(expert_memory=MemoryBudget("bytes", slots * store.native_layout.blob_bytes),
                                      kernels=kernels))


def logits(path, prompt: list[int], steps: int, slots: int | None = None, kernels: str = "auto",
           feed: list[int] | None = None):
    """Our prefill logits [T, V] and `steps` decode steps' logits [V] each: greedy, or fed the tokens `feed` (two
    runs compared on the same inputs, where a near-tie may turn one's greedy path)."""
    with engine(path, slots, kernels) as e:
        assert e.executor.pool.num_slots == (slots or e.spec.num_expert_keys)
        kv, phases = KVCache(e.spec, 1, 64, e.model.w["embed_tokens"].dtype), GenerationStats().phases
        e.executor.begin_step(PREFILL, phases)
        prefill = e.model.forward(StepBatch.prefill([prompt], [0]), kv, all_logits=True)
        out, token = [], prefill[-1].argmax().item() if feed is None else feed[0]
        for i in range(steps):
            e.executor.begin_step(DECODE, phases)
            step = e.model.forward(StepBatch.decode_step([token], [0], [len(prompt) + i], 1), kv)[0]
            out.append(step)
            token = step.argmax().item() if feed is None else feed[(i + 1) % len(feed)]
    return prefill, out


# What a GGUF does not keep, as llama.cpp fixes it: DeepSeek's YaRN mscale (taken equal to mscale_all_dim, as every
# DeepSeek release has them), gpt-oss's SwiGLU limit (7, as released) and Phi's two LongRoPE magnitudes (the one
# the converter computes from the context lengths, √(1 + ln 8 / ln 32) here): the tiny models' are made so here
PHI_MSCALE = (1 + math.log(256 / 32) / math.log(32)) ** 0.5
GGUF_OVERRIDES = {"deepseek_v3": dict(rope_scaling={**FAMILY_CONFIGS["deepseek_v3"]["rope_scaling"], "mscale": 0.8}),
                  "gpt_oss": dict(swiglu_limit=7.0),
                  "phimoe": dict(rope_scaling={**FAMILY_CONFIGS["phimoe"]["rope_scaling"], "short_mscale": PHI_MSCALE,
                                               "long_mscale": PHI_MSCALE})}


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3",
                                    "glm4_moe", "gpt_oss", "phimoe"])
def test_a_gguf_is_the_model_its_folder_is(tiny_store, tmp_path, family):
    """Written as llama.cpp's converter writes it (F32), indexed, run: transformers' logits on the folder to the
    parity tests' tolerance, its 32 greedy tokens, at one layer's top-k slots and at all experts."""
    ref, hf_store = tiny_store(family, **GGUF_OVERRIDES.get(family, {}))
    path = gguf_export.export(hf_store.parent / "hf", tmp_path / f"{family}.gguf")
    store = index_gguf(path, tmp_path / "store", progress=False)
    m = Manifest.load(store)
    # (gpt-oss's experts carry biases: read in place beside them, the converter's F32)
    assert m.native_precision == "fp32" and set(m.sources) == {path.name}
    assert not (store / "experts").exists()
    torch.manual_seed(1)
    prompt = torch.randint(3, ref.config.vocab_size, (11,)).tolist()
    ref_prefill, ref_steps, ref_tokens = reference_run(ref, prompt, 8)
    greedy = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0)[0, len(prompt):]
    for slots in (ref.config.num_experts_per_tok, Store(store).spec.num_expert_keys):
        prefill, steps = logits(store, prompt, 8, slots)
        assert (prefill - ref_prefill).abs().max().item() <= ATOL
        assert max((a - b).abs().max().item() for a, b in zip(steps, ref_steps)) <= ATOL
        with engine_with_slots(store, slots) as engine:
            out = engine.generate([prompt], max_new_tokens=32, ignore_eos=True)
        assert out.token_ids[0][:len(greedy)] == greedy.tolist()


def test_a_bf16_gguf_computes_as_its_bf16_folder(tiny_store, tmp_path):
    """bf16 experts read in place from the file, bf16 dense weights: the very logits of the folder's store."""
    _, hf_store = tiny_store("olmoe", dtype=torch.bfloat16)
    experts = {layer: ("bf16", "bf16") for layer in range(2)}
    path = gguf_export.export(hf_store.parent / "hf", tmp_path / "bf16.gguf", experts, dense_type="bf16")
    assert GgufModel(path).tensor("blk.0.ffn_down_exps.weight").type == "bfloat16"
    store = index_gguf(path, tmp_path / "store", progress=False)
    assert Manifest.load(store).native_precision == "bf16"
    prompt = list(range(5, 16))
    a, b = logits(store, prompt, 6, 2), logits(hf_store, prompt, 6, 2)
    assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.fixture(scope="module")
def k_quant(tmp_path_factory):
    """An OLMoE-shaped tiny model in whole 256-blocks, its experts as a Q4_K_M file keeps them: gate and up Q4_K,
    down Q6_K in layer 0, Q4_K in layer 1 and Q5_0 in layer 2 (llama-quantize's fallback where a row is not
    whole 256-blocks; as many bytes a weight as Q5_K) — with the rest F32 (the model computes in fp32) and in bf16 (in bf16:
    the native kernels' case) —; and the F32 file with every expert at the values gguf's own dequantizer gives
    those blocks."""
    root = tmp_path_factory.mktemp("k_quant")
    build_tiny("olmoe", root / "hf", hidden_size=256, intermediate_size=256, num_attention_heads=4,
               num_key_value_heads=4, num_layers=3)
    kinds = {0: ("q4_k", "q6_k"), 1: ("q4_k", "q4_k"), 2: ("q4_k", "q5_0")}
    quantized = gguf_export.export(root / "hf", root / "q4_k_m.gguf", kinds)
    bf16 = gguf_export.export(root / "hf", root / "q4_k_m-bf16.gguf", kinds, dense_type="bf16")
    blocks = gguf_export.export(root / "hf", root / "q4_k_m-dense.gguf", kinds, dense_type="q4_k",
                                dense_types={"attn_v": "q6_k", "output.": "q6_k", "attn_k": "q5_1"})
    reader = gguf.GGUFReader(quantized)
    rounded = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors
               if "_exps" in t.name}
    floats = gguf_export.export(root / "hf", root / "rounded.gguf", replace=rounded)
    return {name: index_gguf(path, root / name, progress=False)
            for name, path in (("q4_k_m", quantized), ("floats", floats), ("q4_k_m-bf16", bf16),
                               ("q4_k_m-dense", blocks))}


def test_a_files_layers_in_different_types_are_one_precision(k_quant):
    quantized = k_quant["q4_k_m"]
    m = Manifest.load(quantized)
    layout = m.precisions["q4_k"]
    assert m.native_precision == "q4_k"
    assert {layer: layout.tensors_of(layer)[1].dtype for layer in range(3)} == {0: "q6_k", 1: "q4_k", 2: "q5_0"}
    assert layout.blob_bytes >= max(layout.for_layer(i).nbytes for i in range(3))
    assert Store(quantized).read_expert(0, 3)["down_proj"].shape == (256, 210)  # Q6_K: 210 bytes a 256
    assert Store(quantized).read_expert(1, 3)["down_proj"].shape == (256, 144)  # Q4_K: 144
    assert Store(quantized).read_expert(2, 3)["down_proj"].shape == (256, 8, 22)  # Q5_0: 8 blocks of 22 (a shape
    # no k-quant has: Q5_K takes as many bytes a weight)


def test_k_quant_experts_compute_what_their_dequantized_values_do(k_quant):
    """The blocks computed in place (fp32: dequantized, torch's matmul) against the float file holding gguf's
    dequantized values — through a cache of two slots, so one slot holds layer 0's and layer 1's experts in turn."""
    prompt = list(range(3, 14))
    want, got = logits(k_quant["floats"], prompt, 6, 2), logits(k_quant["q4_k_m"], prompt, 6, 2)
    assert (got[0] - want[0]).abs().max().item() <= ATOL
    assert max((a - b).abs().max().item() for a, b in zip(got[1], want[1])) <= ATOL


def test_the_native_kernels_compute_a_files_blocks_as_ggml_does(k_quant):
    """In bf16, the native kernels (integer dot products against the activations in Q8_K, as ggml computes them)
    against torch's path (the blocks dequantized): apart by the activations' 8-bit rounding only."""
    prompt, feed = list(range(3, 14)), [17, 40, 5, 99, 23, 61]
    native, torch_path = (logits(k_quant["q4_k_m-bf16"], prompt, 6, 2, k, feed) for k in ("auto", "torch"))
    for a, b in zip(native[1], torch_path[1]):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() <= 0.03


def test_attention_and_the_head_are_computed_in_the_files_blocks(k_quant):
    """A file whose projections and head are Q4_K: kept in their blocks (BlockMatrix, read from the file) and
    computed by the integer kernels — against the same file's blocks dequantized (`--dense-precision` int8 is
    not asked: torch's kernels take the dequantizing path)."""
    from moetier.model.dense_quant import BlockMatrix

    path = k_quant["q4_k_m-dense"]
    assert set(Manifest.load(path).dense_blocks) >= {"lm_head", "layers.0.q_proj", "layers.1.o_proj"}
    with engine(path, 2) as e:
        assert isinstance(e.model.w["lm_head"], BlockMatrix) and e.dense_bytes < Store(path).dense_bytes
    prompt, feed = list(range(3, 14)), [17, 40, 5, 99, 23, 61]
    native, dequantized = (logits(path, prompt, 6, 2, k, feed) for k in ("auto", "torch"))
    for a, b in zip(native[1], dequantized[1]):  # each product 0.5-0.6% off by the activations' rounding
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() <= 0.05


@pytest.mark.parametrize("family,dense_types", [
    ("deepseek_v3", {"attn_output": "q8_0", "attn_q_a": "q4_k", "attn_kv_a_mqa": "q8_0", "output.": "q6_k"}),
    ("glm4_moe", {"attn_output": "q8_0", "attn_q.": "q4_k", "attn_k.": "q8_0", "output.": "q6_k"})])
def test_a_k_quant_deepseek_or_glm_file_computes_its_blocks(tmp_path, family, dense_types):
    """MLA's and GLM's projections and experts in a file's blocks (a dense first layer, a shared expert, the
    correction bias beside): torch's path equals the same file with every block dequantized by gguf, and the native
    kernels are that apart by the activations' rounding only."""
    build_tiny(family, tmp_path / "hf", hidden_size=256, moe_intermediate_size=256, intermediate_size=256,
               **GGUF_OVERRIDES.get(family, {}))
    path = gguf_export.export(tmp_path / "hf", tmp_path / "q.gguf", {1: ("q4_k", "q6_k")}, dense_types=dense_types)
    rounded = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(path).tensors
               if t.tensor_type.name not in ("F32", "F16", "BF16")}
    floats = gguf_export.export(tmp_path / "hf", tmp_path / "floats.gguf", replace=rounded)
    quantized, want = (index_gguf(p, tmp_path / p.stem, progress=False) for p in (path, floats))
    assert {"lm_head", "layers.0.o_proj", "layers.1.o_proj"} <= set(Manifest.load(quantized).dense_blocks)
    assert Manifest.load(quantized).native_precision == "q4_k"
    prompt, feed = list(range(3, 14)), [17, 40, 5, 99, 23, 61]
    a, b = logits(quantized, prompt, 6, 2, "torch", feed), logits(want, prompt, 6, 2, "torch", feed)
    assert (a[0] - b[0]).abs().max().item() <= ATOL
    assert max((x - y).abs().max().item() for x, y in zip(a[1], b[1])) <= ATOL
    native = logits(quantized, prompt, 6, 2, "auto", feed)
    for x, y in zip(native[1], a[1]):
        assert ((x.float() - y.float()).norm() / y.float().norm()).item() <= 0.05


def test_types_the_kernels_do_not_compute_are_dequantized_once_with_a_note(tmp_path, capsys):
    """Q3_K and IQ4_XS experts (a Q3_K_M's and an IQ4_XS file's), MXFP4 and Q2_K ones, a Q3_K projection: dequantized
    by the gguf package once while indexing — the experts into the store's own copies, said in a note with what
    they cost — and the model computes what the same file holding those values in F32 does."""
    build_tiny("olmoe", tmp_path / "hf", hidden_size=256, intermediate_size=256, num_key_value_heads=4)
    kinds = {0: ("Q3_K", "IQ4_XS"), 1: ("MXFP4", "Q2_K")}
    path = gguf_export.export(tmp_path / "hf", tmp_path / "q3.gguf", kinds, dense_types={"attn_q.": "Q3_K"})
    rounded = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(path).tensors
               if t.tensor_type.name not in ("F32", "F16", "BF16")}
    floats = gguf_export.export(tmp_path / "hf", tmp_path / "floats.gguf", replace=rounded)
    info = inspect_model(path)  # what doctor and sim see: the copies' layout (fp32 gate·up and down)
    assert info.precision == "fp32" and 3 * 256 * 256 * 4 <= info.blob_bytes < 3 * 256 * 256 * 4 + 8192
    store = index_gguf(path, tmp_path / "store", progress=False)
    err = capsys.readouterr().err
    assert "experts of q3.gguf are Q3_K, IQ4_XS, MXFP4, Q2_K; moetier's kernels do not compute Q3_K, IQ4_XS, " \
           "Q2_K: copied once here to fp32 in the store (12.0 MiB written, 8.6x the file's 1.4 MiB); requantized" in err
    assert "2 dense tensors of q3.gguf (55.0 KiB, e.g. blk.0.attn_q.weight) are computed in float32" in err
    m = Manifest.load(store)
    assert m.native_precision == "fp32" and (store / "experts").exists() and "layers.0.q_proj" not in m.dense_blocks
    want = index_gguf(floats, tmp_path / "floats", progress=False)
    prompt = list(range(3, 14))
    a, b = logits(store, prompt, 6, 2), logits(want, prompt, 6, 2)
    assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def test_a_gpt_oss_mxfp4_file_reads_its_experts_and_biases_in_place(tmp_path, capsys):
    """gpt-oss as its released GGUFs hold it (MXFP4 experts beside F32 biases, sinks, the router's bias): the experts
    read in place, blocks and biases (nothing copied), and the model computes — through torch's path (the blocks
    dequantized) — what the same file with the MXFP4 blocks' values in F32 does; in bf16 through the native kernels
    (the activations rounded to int8 blocks, as llama.cpp computes MXFP4; the sinks' attention native too) that
    apart by the roundings only."""
    build_tiny("gpt_oss", tmp_path / "hf", hidden_size=256, intermediate_size=256, **GGUF_OVERRIDES["gpt_oss"])
    path = gguf_export.export(tmp_path / "hf", tmp_path / "mxfp4.gguf", {0: ("MXFP4", "MXFP4"), 1: ("MXFP4", "MXFP4")})
    rounded = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(path).tensors
               if t.tensor_type.name == "MXFP4"}
    assert len(rounded) == 6
    floats = gguf_export.export(tmp_path / "hf", tmp_path / "floats.gguf", replace=rounded)
    capsys.readouterr()
    store = index_gguf(path, tmp_path / "store", progress=False)
    assert "copied" not in capsys.readouterr().err and not (store / "experts").exists()
    assert Manifest.load(store).native_precision == "mxfp4"
    expert = Store(store).read_expert(1, 3)
    in_file = {p: torch.from_numpy(gguf_tensor(path, f"blk.1.ffn_{p}")[3].copy())
               for p in ("gate_exps.bias", "up_exps.bias", "down_exps.bias", "down_exps.weight")}
    assert torch.equal(expert["down_proj.bias"], in_file["down_exps.bias"])
    assert torch.equal(expert["gate_up_proj.bias"], torch.cat([in_file["gate_exps.bias"], in_file["up_exps.bias"]]))
    assert torch.equal(expert["down_proj"].flatten(), in_file["down_exps.weight"].flatten())
    want = index_gguf(floats, tmp_path / "floats", progress=False)
    prompt, feed = list(range(3, 14)), [17, 40, 5, 99, 23, 61]
    a, b = logits(store, prompt, 6, 2, "torch", feed), logits(want, prompt, 6, 2, "torch", feed)
    assert (a[0] - b[0]).abs().max().item() <= ATOL
    assert max((x - y).abs().max().item() for x, y in zip(a[1], b[1])) <= ATOL
    bf16 = index_gguf(gguf_export.export(tmp_path / "hf", tmp_path / "mxfp4-bf16.gguf", {0: ("MXFP4", "MXFP4"),
                                         1: ("MXFP4", "MXFP4")}, dense_type="bf16"), tmp_path / "bf16", progress=False)
    native = logits(bf16, prompt, 6, 2, "auto", feed)  # against the values in fp32: the activations' rounding to
    # int8 blocks and bf16's apart (torch's bf16 path: at most 2.1% a step; the native one 1.5-4.3%)
    errors = [((x.float() - y.float()).norm() / y.float().norm()).item() for x, y in zip(native[1], b[1])]
    assert 0 < sum(errors) / len(errors) <= 0.04 and max(errors) <= 0.08


def test_a_gpt_oss_file_whose_expert_biases_do_not_fit_its_experts_is_refused(tmp_path):
    """A layer's expert biases of another shape than its metadata implies: refused in one line naming the tensor,
    before anything is written."""
    build_tiny("gpt_oss", tmp_path / "hf", hidden_size=256, intermediate_size=256, **GGUF_OVERRIDES["gpt_oss"])
    good = gguf_export.export(tmp_path / "hf", tmp_path / "good.gguf", {0: ("MXFP4", "MXFP4"), 1: ("MXFP4", "MXFP4")})
    bias = gguf_tensor(good, "blk.1.ffn_down_exps.bias")  # [E, H]
    bad = gguf_export.export(tmp_path / "hf", tmp_path / "bad.gguf", {0: ("MXFP4", "MXFP4"), 1: ("MXFP4", "MXFP4")},
                             replace={"blk.1.ffn_down_exps.bias": bias[:, :-32]})
    with pytest.raises(GgufError, match=r"blk.1.ffn_down_exps.bias is \(\d+, 224\); the file's metadata implies"):
        index_gguf(bad, tmp_path / "store", progress=False)
    assert not (tmp_path / "store").exists()

def gguf_tensor(path: Path, name: str) -> np.ndarray:
    return next(np.asarray(t.data) for t in gguf.GGUFReader(path).tensors if t.name == name)


def test_a_gguf_budget_counts_the_blocks_kept_not_their_float_copies(k_quant):
    """The dense weights a GGUF's run keeps: its projections and head in the file's blocks, not the float copies the
    store holds of them too (counted, they made the OLMoE-shaped Q4_K_M file refuse a 0.78 GiB cap it now runs in)."""
    from moetier.model.dense_quant import quantized_dense_bytes

    store = Store(k_quant["q4_k_m-dense"])
    blocks = {name: b.nbytes for name, b in store.manifest.dense_blocks.items()}
    with engine(store.path, 2) as e:
        assert e.budget.dense_bytes == quantized_dense_bytes(store.dense_tensors(), "native", blocks)
        assert e.budget.dense_bytes < store.dense_bytes and e.dense_bytes == e.budget.dense_bytes


@pytest.fixture(scope="module")
def qwen2_k_quant(tmp_path_factory):
    """A Qwen2-MoE (q/k/v biases, a shared expert) in whole 256-blocks, everything Q4_K but attn_v (Q6_K)."""
    root = tmp_path_factory.mktemp("qwen2_k_quant")
    build_tiny("qwen2_moe", root / "hf", hidden_size=256, moe_intermediate_size=256, intermediate_size=256,
               shared_expert_intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    path = gguf_export.export(root / "hf", root / "m.gguf", {0: ("q4_k", "q4_k"), 1: ("q4_k", "q6_k")},
                              dense_type="q4_k", dense_types={"attn_v": "q6_k"})
    return index_gguf(path, root / "store", progress=False)


@pytest.mark.parametrize("which", ["olmoe", "qwen2_moe"])
@pytest.mark.parametrize("budget", ["100%", "50%"])
def test_the_native_decode_block_computes_a_files_blocks_bit_for_bit(k_quant, qwen2_k_quant, which, budget):
    """The attention block in one native call (decode_block.c), its q, k and v in their own types (v Q6_K beside
    Q4_K q and k), with and without biases: the layer-by-layer forward's logits, bit for bit."""
    from tests.model.test_decode_block import decode_logits

    path = k_quant["q4_k_m-dense"] if which == "olmoe" else qwen2_k_quant
    assert Manifest.load(path).dense_blocks["layers.0.v_proj"].fmt == "q6_k"
    with Engine.from_pretrained(path, expert_memory=budget, kernels="native", progress=False) as e:
        assert e.model.blocks is not None
        fused, layered = decode_logits(e, blocks=True), decode_logits(e, blocks=False)
    assert all(torch.equal(a, b) for a, b in zip(fused, layered))


@pytest.mark.parametrize("which", ["olmoe", "qwen2_moe"])
def test_a_batchs_decode_blocks_compute_a_files_blocks_bit_for_bit(k_quant, qwen2_k_quant, which):
    """Three sequences' attention in one native call a layer (moetier_decode_block_rows: q, k and v in their own
    types, each part's activations quantized once for all rows): the layer-by-layer forward's logits, bit for bit."""
    from tests.model.test_decode_block import batch_logits

    path = k_quant["q4_k_m-dense"] if which == "olmoe" else qwen2_k_quant
    with Engine.from_pretrained(path, expert_memory="100%", kernels="native", progress=False) as e:
        assert e.model.blocks is not None
        fused, layered = batch_logits(e, True, [1, 0, 2]), batch_logits(e, False, [1, 0, 2])
    assert all(torch.equal(a, b) for a, b in zip(fused, layered))


def test_quantized_copies_of_a_gguf_are_made_from_its_values(k_quant, tmp_path):
    """HOBBIT's and int4's copies of a Q4_K_M file's experts (each layer's own formats, Q5_0 included) are made
    from the values its blocks stand for, as from a float checkpoint's."""
    from moetier.quant.codes import quantize_expert
    from moetier.quant.ggml_blocks import dequantize
    from moetier.store.variants import add_precisions

    store = index_gguf(Manifest.load(k_quant["q4_k_m"]).source, tmp_path / "store", progress=False)
    assert add_precisions(store, "int4", progress=False) == ["int4"]
    s = Store(store)
    for layer, fmt in ((0, "q6_k"), (2, "q5_0")):
        blocks = s.read_expert(layer, 5)
        values = {"gate_up_proj": dequantize(blocks["gate_up_proj"], "q4_k"),
                  "down_proj": dequantize(blocks["down_proj"].reshape(256, -1), fmt)}
        want, got = quantize_expert(values, "int4"), s.read_expert(layer, 5, "int4")
        assert all(torch.equal(want[name], got[name]) for name in want)


def test_a_gguf_decode_step_in_one_native_call_is_the_layers_bit_for_bit(k_quant, monkeypatch):
    """Every expert resident: the whole step in one call (decode_step.c) — the file's attention blocks, its experts
    through their table of blocks and types — against the layer-by-layer forward, bit for bit."""
    from moetier.model.resident_step import ResidentStep
    from tests.model.test_resident_step import run

    calls = []
    step_call = ResidentStep.__call__
    monkeypatch.setattr(ResidentStep, "__call__", lambda self, kv: calls.append(1) or step_call(self, kv))
    with Engine.from_pretrained(k_quant["q4_k_m-dense"], expert_memory="100%", kernels="native",
                                progress=False) as e:
        assert e.model.resident_step is not None
        e.preload()
        whole, layered = run(e, whole=True), run(e, whole=False)
    assert len(calls) == 6
    assert all(torch.equal(a, b) for a, b in zip(whole[0], layered[0]))


def test_a_gguf_chats_with_the_template_and_tokenizer_it_carries(tmp_path):
    """demo-deep written as a GGUF with its tokenizer and chat template in `tokenizer.ggml.*` and
    `tokenizer.chat_template` (as the converter writes them): the engine renders and tokenizes a conversation as
    the Hugging Face folder's files do, and answers."""
    import json

    from moetier.engine.tokenizer import Tokenizer

    settings = json.loads((DEMO_DIR / "tokenizer_config.json").read_text())
    config = json.loads((DEMO_DIR / "config.json").read_text())
    meta = {**gguf_writer.tokenizer_metadata(DEMO_DIR / "tokenizer.json"), "tokenizer.chat_template": settings["chat_template"],
            "tokenizer.ggml.bos_token_id": config["bos_token_id"], "tokenizer.ggml.eos_token_id": config["eos_token_id"]}
    path = gguf_export.export(DEMO_DIR, tmp_path / "demo-deep.gguf", tokenizer=meta)
    messages = [{"role": "user", "content": "Where is the old man?"}]
    folder = Tokenizer.from_file(DEMO_DIR / "tokenizer.json", config["bos_token_id"])
    want = folder.encode(folder.chat_template.render(messages), add_bos=False)
    with Engine.from_pretrained(path, expert_memory="100%", cache_dir=tmp_path / "cache", progress=False) as e:
        assert e.tokenizer.encode(e.tokenizer.chat_template.render(messages), add_bos=False) == want
        assert e.chat(messages, max_new_tokens=6)


def test_the_families_list_names_their_gguf_architectures(capsys):
    assert main(["list", "families"]) == 0
    out = capsys.readouterr().out
    assert "GGUF arch: olmoe" in out and "GGUF arch: llama (with experts)" in out and "GGUF arch: qwen3moe" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "GGUF arch: deepseek2" in lines["deepseek_v2"] and "GGUF arch: deepseek2" in lines["deepseek_v3"]
    assert "GGUF arch: glm4moe" in lines["glm4_moe"] and "GGUF arch: gpt-oss" in lines["gpt_oss"]
    assert "GGUF arch: phimoe" in lines["phimoe"] and "GGUF arch" not in lines["switch_transformers"]


def test_dense_weights_in_a_block_format_are_dequantized_once_with_a_note(tiny_store, tmp_path, capsys):
    _, hf_store = tiny_store("olmoe")
    path = gguf_export.export(hf_store.parent / "hf", tmp_path / "m.gguf", dense_type="q8_0")
    store = Store(index_gguf(path, tmp_path / "store", progress=False))
    note = capsys.readouterr().err
    assert "dense tensors of m.gguf" in note and "dequantized once" in note
    q = GgufModel(path).tensor("blk.1.attn_q.weight")
    want = torch.from_numpy(gguf.quants.dequantize(q.data, gguf.GGMLQuantizationType.Q8_0))
    assert Manifest.load(store.path).config["dtype"] == "float32"  # the experts' (F32)
    assert torch.equal(store.load_dense()["layers.1.q_proj"], want)


def test_moetier_runs_a_gguf_named_on_the_command_line(k_quant, tmp_path, capsys):
    """`--model FILE.gguf`: indexed into the cache once, then reused; the file itself untouched."""
    path = Path(Manifest.load(k_quant["q4_k_m"]).source)
    before = path.stat()
    args = ["generate", "--model", str(path), "--cache-dir", str(tmp_path / "cache"), "--prompt", "hello",
            "--max-tokens", "4", "--temperature", "0"]
    assert main(args) == 0
    assert main(args) == 0
    entries = list((tmp_path / "cache").iterdir())
    assert len([e for e in entries if e.name.startswith("q4_k_m-")]) == 1
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert resolve_model(path, tmp_path / "cache", progress=False) in entries


def test_a_gguf_changed_after_indexing_is_indexed_again_or_refused(tmp_path, tiny_store):
    _, hf_store = tiny_store("olmoe")
    path = gguf_export.export(hf_store.parent / "hf", tmp_path / "m.gguf")
    store = index_gguf(path, tmp_path / "store", progress=False)
    first = resolve_model(path, tmp_path / "cache", progress=False)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(StoreError, match="changed since .* indexed it"):
        Store(store)
    second = resolve_model(path, tmp_path / "cache", progress=False)  # `--model FILE`: a new index, the old gone
    assert second != first and not first.exists()


def test_bytes_that_rot_in_a_gguf_fail_their_checksum_naming_the_file(tmp_path, tiny_store):
    _, hf_store = tiny_store("olmoe")
    path = gguf_export.export(hf_store.parent / "hf", tmp_path / "m.gguf")
    store = index_gguf(path, tmp_path / "store", progress=False)
    down = GgufModel(path).tensor("blk.1.ffn_down_exps.weight")
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(down.offset + 6 * down.nbytes // down.shape[0] + 8)  # inside expert 6's slice
        f.write(b"\xff\xff\xff\xff")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with Engine.from_pretrained(store, expert_memory="100%", progress=False) as engine:
        with pytest.raises(ChecksumError, match=r"expert 6 of layer 1.*m\.gguf"):
            engine.preload()


@pytest.mark.parametrize("change,words", [
    ({"blk.1.ffn_up_exps.weight": "q8_0"}, "moetier keeps an expert's gate and up in one type"),
    ({"blk.1.ffn_gate_exps.weight": "q8_0", "blk.1.ffn_up_exps.weight": "q8_0"}, "in several types"),
    ({"blk.0.ffn_down_exps.weight": "shape"}, "the file's metadata implies"),
])
def test_experts_a_file_keeps_otherwise_than_moetier_reads_are_refused_in_one_line(tmp_path, capsys, change, words):
    """Gate and up in two types, layers whose gate and up differ in type, an expert tensor not of the metadata's
    shape: each one line naming the tensors, exit 1, nothing in the cache."""
    rng = np.random.default_rng(0)
    tensors = gguf_writer.olmoe_tensors(rng, expert_type="q4_k")
    for name, kind in change.items():
        values = tensors[name][0]
        tensors[name] = values[:, :, :128] if kind == "shape" else (values, kind)
    path = gguf_writer.write(tmp_path / "odd.gguf", "olmoe", gguf_writer.olmoe_keys(), tensors,
                             gguf_writer.tokenizer_metadata(DEMO_DIR / "tokenizer.json"))
    cache = tmp_path / "cache"
    assert main(["generate", "--model", str(path), "--cache-dir", str(cache), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("moetier: error:") and words in err[0] and len(err) == 2
    assert not cache.exists() or not any(p for p in cache.iterdir() if not p.name.startswith("."))


def test_a_gguf_that_cannot_run_is_one_line_and_writes_nothing(tmp_path, capsys):
    bad = gguf_writer.write(tmp_path / "dense.gguf", "llama", {"block_count": 1, "embedding_length": 64},
                            {"token_embd.weight": np.zeros((8, 64), np.float32)})
    cache = tmp_path / "cache"
    code = main(["generate", "--model", str(bad), "--cache-dir", str(cache), "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 2 and err[0].startswith("moetier: error:") and "dense llama" in err[0]
    assert not cache.exists() or not any(cache.iterdir())
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert main(["generate", "--model", str(text), "--prompt", "hi"]) == 1
    assert "is a file, not a model" in capsys.readouterr().err
