"""bench/peers/gpt_oss_synth.py: a gpt-oss GGUF as llama-quantize's MXFP4_MOE writes it, written again at other
shapes with random blocks — the file compare.py's `mxfp4_moe` rows run in both engines — and the rows that run it."""

import gguf
import pytest

from moetier.store.gguf_store import index_gguf
from tests.bench.test_peers_pairs import load_compare
from tests.store import gguf_export
from tests.tiny_models import build_tiny

SMALL = dict(hidden=64, intermediate=96, experts=4, top_k=2, layers=3, heads=4, kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """A tiny gpt-oss in MXFP4_MOE's types (MXFP4 experts, Q8_0 matrices, F32 norms, biases and router) written
    again at SMALL's shapes (3 layers where it has 2)."""
    load_compare()  # (bench/peers on the path)
    import gpt_oss_synth

    root = tmp_path_factory.mktemp("gpt_oss")
    build_tiny("gpt_oss", root / "hf", hidden_size=64, intermediate_size=64, swiglu_limit=7.0)
    tiny = gguf_export.export(root / "hf", root / "tiny.gguf", {0: ("MXFP4", "MXFP4"), 1: ("MXFP4", "MXFP4")},
                              dense_type="q8_0")
    vocab = len(gguf.GGUFReader(tiny).fields["tokenizer.ggml.tokens"].contents()) + 37
    shape = dict(SMALL, vocab=vocab)
    return gpt_oss_synth, tiny, gpt_oss_synth.scale_up(tiny, root / "big.gguf", shape), shape


def test_the_file_has_the_shapes_asked_in_the_tiny_files_types(scaled):
    synth, tiny, big, shape = scaled
    small, out = gguf.GGUFReader(tiny), gguf.GGUFReader(big)
    kinds = {t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name: t.tensor_type.name
             for t in small.tensors}
    top = [t for t in small.tensors if not t.name.startswith("blk.")]
    assert len(out.tensors) == len(top) + (len(small.tensors) - len(top)) // 2 * 3  # (a layer's tensors, 3 times)
    for t in out.tensors:
        part = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
        assert t.tensor_type.name == kinds[part]
        assert tuple(reversed(t.shape.tolist())) == synth.tensor_shape(t.name, shape)
    assert {t.name.split(".")[1] for t in out.tensors if t.name.startswith("blk.")} == {"0", "1", "2"}
    assert out.fields["gpt-oss.block_count"].contents() == 3
    assert out.fields["gpt-oss.expert_count"].contents() == 4
    assert out.fields["gpt-oss.embedding_length"].contents() == 64
    tokens = out.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == shape["vocab"] and tokens[-1] == "[PAD36]"
    assert len(out.fields["tokenizer.ggml.token_type"].contents()) == shape["vocab"]
    gate = next(t for t in out.tensors if t.name == "blk.2.ffn_gate_exps.weight")
    assert (gate.data.reshape(-1, 17)[:, 0] == 120).all()  # every MXFP4 block's exponent: weights of ~0.02


def test_moetier_reads_its_experts_in_place_and_decodes(scaled, tmp_path):
    from moetier import Engine
    from moetier.config import MemoryBudget
    from moetier.engine.engine import EngineConfig
    from moetier.store.format import Manifest
    from moetier.store.store import Store

    _, _, big, _ = scaled
    store = index_gguf(big, tmp_path / "store", progress=False)
    assert Manifest.load(store).native_precision == "mxfp4" and not (store / "experts").exists()
    with Engine(Store(store), EngineConfig(expert_memory=MemoryBudget.parse("100%"))) as engine:
        out = engine.generate([[3, 4, 5, 6]], max_new_tokens=4, ignore_eos=True)
    assert len(out.token_ids[0]) == 4


def test_compare_knows_the_gpt_oss_rows_and_titles_them():
    compare = load_compare()
    assert compare.MODES["mxfp4_moe"] == [(compare.SAME_FILE, "native", "native")]
    assert compare.title_model([{"format": "mxfp4_moe"}]) == "gpt-oss-20b-shaped"
    assert compare.title_model([{"format": "q4_k_m"}, {"format": "mxfp4_moe"}]) == \
        "OLMoE-1B-7B-shaped and gpt-oss-20b-shaped"
    import llamacpp

    assert llamacpp.GGUF_TYPES["mxfp4_moe"] == "MXFP4_MOE"
