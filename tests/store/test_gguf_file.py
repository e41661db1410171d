"""GGUF files read as models: metadata onto the config a family parses, tensors found where the file keeps them,
the tokenizer rebuilt from the metadata, and every file that cannot be read refused in one line."""

from pathlib import Path

import numpy as np
import pytest
import torch

from moetier.model.families import parse_spec
from moetier.quant.ggml_blocks import dequantize
from moetier.store.gguf_file import GgufError, GgufModel, split_parts, unpermute
from moetier.store.gguf_tokenizer import build, tokenizer_files
from tests.store import gguf_writer

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-deep"


@pytest.fixture(scope="module")
def olmoe_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    tensors = gguf_writer.olmoe_tensors(rng, expert_type="q4_k")
    path = tmp_path_factory.mktemp("gguf") / "tiny-olmoe-q4_k.gguf"
    gguf_writer.write(path, "olmoe", gguf_writer.olmoe_keys(), tensors,
                      gguf_writer.tokenizer_metadata(DEMO / "tokenizer.json"))
    return path, tensors


def test_the_metadata_is_the_config_a_family_parses(olmoe_file):
    path, _ = olmoe_file
    m = GgufModel(path)
    cfg = m.config()
    assert cfg["model_type"] == "olmoe" and cfg["num_experts"] == 4 and cfg["num_experts_per_tok"] == 2
    assert cfg["intermediate_size"] == 256 and cfg["hidden_size"] == 256 and cfg["num_hidden_layers"] == 2
    assert cfg["vocab_size"] == 300 and cfg["tie_word_embeddings"] is False
    assert cfg["rms_norm_eps"] == 1e-6  # the config's decimal, not the float32 the file holds (9.99999997e-07)
    spec = parse_spec(cfg)
    assert spec.num_experts == 4 and spec.top_k == 2 and spec.moe_layers == (0, 1)


def test_each_tensor_is_where_the_file_keeps_it(olmoe_file):
    path, written = olmoe_file
    m = GgufModel(path)
    gate = m.tensor("blk.1.ffn_gate_exps.weight")
    assert gate.type == "q4_k" and gate.shape == (4, 256, 256)
    raw = np.fromfile(path, np.uint8, count=gate.nbytes, offset=gate.offset).reshape(4, 256, -1)
    expert = dequantize(torch.from_numpy(raw[2].copy()), "q4_k")  # expert 2: its own contiguous slice
    values = written["blk.1.ffn_gate_exps.weight"][0][2]
    assert ((expert - torch.from_numpy(values)).norm() / np.linalg.norm(values)).item() < 0.1
    norm = m.tensor("blk.0.attn_norm.weight")
    assert norm.type == "float32" and np.array_equal(np.asarray(norm.data), written["blk.0.attn_norm.weight"])


def test_the_tokenizer_encodes_as_the_one_it_came_from():
    from tokenizers import Tokenizer

    original = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    rebuilt = build(gguf_writer.tokenizer_metadata(DEMO / "tokenizer.json"))
    text = "The old man said, \u201cIt's 1,200 miles!\u201d\n\n  And then   he left.<|endoftext|>Caf\u00e9 \u00fcber"
    assert rebuilt.encode(text).ids == original.encode(text).ids
    assert rebuilt.decode(original.encode(text).ids) == original.decode(original.encode(text).ids)
    files = tokenizer_files({**gguf_writer.tokenizer_metadata(DEMO / "tokenizer.json"),
                             "tokenizer.ggml.eos_token_id": 0, "tokenizer.chat_template": "{{ messages }}"})
    assert b'"eos_token": "<|endoftext|>"' in files["tokenizer_config.json"]
    assert b"chat_template" in files["tokenizer_config.json"]


def test_an_unknown_pre_tokenizer_or_model_is_refused_by_name():
    meta = gguf_writer.tokenizer_metadata(DEMO / "tokenizer.json")
    with pytest.raises(GgufError, match="'tekken'"):
        build({**meta, "tokenizer.ggml.pre": "tekken"})
    with pytest.raises(GgufError, match="'llama'"):
        build({**meta, "tokenizer.ggml.model": "llama"})


def test_llamas_qk_permutation_is_undone():
    """The converter's LlamaModel.permute, written out, then undone."""
    heads, head_dim = 4, 8
    w = torch.randn(heads * head_dim, 16)
    permuted = w.reshape(heads, 2, head_dim // 2, 16).swapaxes(1, 2).reshape(w.shape)
    assert not torch.equal(permuted, w) and torch.equal(unpermute(permuted, heads), w)


def test_a_dense_model_or_another_architecture_is_refused(tmp_path):
    rng = np.random.default_rng(1)
    keys = {k: v for k, v in gguf_writer.olmoe_keys().items() if not k.startswith("expert")}
    dense = gguf_writer.write(tmp_path / "dense.gguf", "llama", keys, {"token_embd.weight": rng.random((8, 4))})
    with pytest.raises(GgufError, match="dense llama model"):
        GgufModel(dense)
    other = gguf_writer.write(tmp_path / "mamba.gguf", "mamba", keys, {"token_embd.weight": rng.random((8, 4))})
    with pytest.raises(GgufError, match="'mamba' is not one moetier runs"):
        GgufModel(other)


def test_a_truncated_file_is_one_line(olmoe_file, tmp_path):
    path, _ = olmoe_file
    short = tmp_path / "short.gguf"
    short.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(GgufError, match="not a readable GGUF file"):
        GgufModel(short)
    (tmp_path / "text.gguf").write_text("hello")
    with pytest.raises(GgufError, match="not a readable GGUF file"):
        GgufModel(tmp_path / "text.gguf")


def test_an_unknown_tensor_type_is_named(tmp_path):
    """A type neither our kernels nor the gguf package's dequantizers read (Q8_K: ggml's activation blocks)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path / "q8k.gguf"
    w = GGUFWriter(path, "olmoe")
    for key, value in gguf_writer.olmoe_keys().items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(f"olmoe.{key}", value)
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4, 292), np.uint8), raw_shape=(4, 292),
                 raw_dtype=GGMLQuantizationType.Q8_K)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(GgufError, match="types moetier does not read: Q8_K"):
        GgufModel(path)


def test_a_split_set_names_its_missing_part(tmp_path):
    first = tmp_path / "model-00001-of-00003.gguf"
    for i in (1, 3):
        (tmp_path / f"model-0000{i}-of-00003.gguf").write_bytes(b"")
    with pytest.raises(GgufError, match="missing: model-00002-of-00003.gguf"):
        split_parts(first)
    (tmp_path / "model-00002-of-00003.gguf").write_bytes(b"")
    assert [p.name for p in split_parts(first)] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert split_parts(tmp_path / "model.gguf") == [tmp_path / "model.gguf"]


def test_an_arch_stands_for_at_least_one_family():
    from moetier.store.gguf_file import ARCHES, ArchSpec

    assert ARCHES["deepseek2"].model_types == ("deepseek_v2", "deepseek_v3") and ARCHES["deepseek2"].model_type == "deepseek_v2"
    with pytest.raises(ValueError, match="at least one model_type"):
        ArchSpec((), lambda m: {})
