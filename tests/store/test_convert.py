"""The store format, atomic conversion, and every way a checkpoint or store can be bad."""

import json
import os
import zlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetier.atomic import ReplaceError
from moetier.errors import (
    CheckpointError,
    ChecksumError,
    ModelNotFoundError,
    StoreError,
    UnsupportedModelError,
)
from moetier.model.families import FAMILIES
from moetier.store.convert import convert
from moetier.store.format import ALIGN, Manifest
from moetier.store.store import Store
from tests.tiny_models import build_tiny


def test_layout_is_aligned_and_checksummed(tiny_store):
    ref, path = tiny_store("qwen2_moe", copy=True)
    m = Manifest.load(path)
    assert m.native_precision == "fp32" and len(m.blobs) == 2 * 8
    for b in m.blobs:
        assert b.offset % ALIGN == 0 and b.length % ALIGN == 0
        with open(path / b.file, "rb") as f:
            f.seek(b.offset)
            assert zlib.crc32(f.read(b.length)) == b.crc32
    # blob contents are the checkpoint's expert weights, gate and up packed
    layout = m.precisions["fp32"]
    b = m.blob(1, 5)
    raw = (path / b.file).read_bytes()[b.offset:b.offset + layout.nbytes]
    t = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    gu = t[:2 * 48 * 64].view(96, 64)
    assert torch.equal(gu[:48], ref.model.layers[1].mlp.experts.gate_up_proj[5][:48])
    assert (path / "dense.safetensors").exists() and "layers.0.shared.gate_up_proj" in Store(path).load_dense()


def test_convert_refuses_to_overwrite_without_force(tiny_store, tmp_path):
    _, path = tiny_store("olmoe")
    src = Manifest.load(path).source
    with pytest.raises(ReplaceError, match="already exists"):
        convert(src, path, progress=False)


def no_leftovers(parent):
    return not [p for p in os.listdir(parent) if ".tmp-" in p]


def test_missing_expert_tensor_names_it_and_leaves_nothing(tmp_path):
    build_tiny("mixtral", tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"experts\.3\.w2\.weight.*missing"):
        convert(tmp_path / "hf", tmp_path / "store", progress=False)
    assert not (tmp_path / "store").exists() and no_leftovers(tmp_path)


def test_unsupported_family_names_the_supported_ones(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UnsupportedModelError) as refused:
        convert(tmp_path / "m", tmp_path / "store", progress=False)
    assert "'llama' is not supported" in str(refused.value)
    for family in FAMILIES:
        assert family in refused.value.hint
    assert not (tmp_path / "store").exists()


def test_deepseek_v1_is_refused_with_the_reason(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "deepseek", "n_routed_experts": 64}))
    with pytest.raises(UnsupportedModelError, match="remote code.*no reference"):
        convert(tmp_path / "m", tmp_path / "store", progress=False)


def test_missing_and_unreadable_model_folder(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        convert(tmp_path / "nope", tmp_path / "store", progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelNotFoundError, match="not a folder"):
        convert(tmp_path / "file", tmp_path / "store", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        convert(tmp_path / "empty", tmp_path / "store", progress=False)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        convert(tmp_path / "bad", tmp_path / "store", progress=False)


def copy_store(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_truncated_store_is_refused(tiny_store, tmp_path):
    _, path = tiny_store("olmoe", copy=True)
    store = copy_store(path, tmp_path / "s")
    f = store / "experts" / "fp32" / "layer_001.bin"
    os.truncate(f, f.stat().st_size - ALIGN)
    with pytest.raises(StoreError, match="truncated"):
        Store(store)


def test_incomplete_store_is_refused(tiny_store, tmp_path):
    _, path = tiny_store("olmoe")
    store = copy_store(path, tmp_path / "s")
    d = json.loads((store / "manifest.json").read_text())
    d["complete"] = False
    (store / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(StoreError, match="incomplete"):
        Store(store)
    (store / "manifest.json").unlink()
    with pytest.raises(StoreError, match="not a moetier store"):
        Store(store)


def test_corrupt_blob_fails_its_checksum_naming_layer_and_expert(tiny_store, tmp_path):
    from moetier import Engine

    _, path = tiny_store("olmoe", copy=True)
    store = copy_store(path, tmp_path / "s")
    blob = Manifest.load(store).blob(1, 6)
    with open(store / blob.file, "r+b") as f:
        f.seek(blob.offset + 100)
        f.write(b"\xff\xff\xff\xff")
    with Engine.from_pretrained(store, expert_memory="100%") as engine:
        with pytest.raises(ChecksumError, match=r"expert 6 of layer 1.*(?s:.*)re-convert"):
            engine.preload()
        assert (1, 6) not in engine.executor.residency  # a failed load leaves nothing behind


@pytest.mark.parametrize("change,match", [
    ({"mlp_bias": True}, "mlp_bias"),
    ({"topk_method": "noaux_tc"}, "topk_method"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "RoPE type 'llama3'"),
    ({"num_experts_per_tok": 9}, "exceeds the number of experts"),
])
def test_what_a_family_does_not_run_is_refused(tmp_path, change, match):
    """A DeepSeek-V2 config naming something moetier does not run: refused, naming it, before any tensor is read."""
    from moetier.model.families import parse_spec
    from tests.tiny_models import tiny_config

    cfg = {**tiny_config("deepseek_v2").to_dict(), **change}
    with pytest.raises(UnsupportedModelError, match=match):
        parse_spec(cfg)


@pytest.mark.parametrize("family,change,match", [
    ("phimoe", {"num_experts_per_tok": 3}, "exactly 2 experts"),
    ("deepseek_v3", {"n_group": 3, "topk_group": 1}, "do not split"),
    ("deepseek_v3", {"n_group": 8, "topk_group": 1}, "two best"),
    ("deepseek_v3", {"num_experts_per_tok": 5}, "cannot be chosen"),
    ("deepseek_v2", {"first_k_dense_replace": 2}, "leaves no MoE layer"),
    ("glm4_moe", {"partial_rotary_factor": 1.5, "rope_parameters": None}, "partial_rotary_factor"),
    ("phimoe", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0],
                                    "long_factor": [1.0], "original_max_position_embeddings": 32}}, "need 8 entries"),
    ("gpt_oss", {"layer_types": ["full_attention"]}, "layer_types must list"),
    ("switch_transformers", {"dense_act_fn": "gelu"}, "dense_act_fn"),
    ("switch_transformers", {"router_dtype": "bfloat16"}, "router_dtype"),
    ("switch_transformers", {"num_sparse_encoder_layers": 0, "num_sparse_decoder_layers": 0}, "dense T5"),
])
def test_what_the_new_families_do_not_run_is_refused(family, change, match):
    from moetier.model.families import parse_spec
    from tests.tiny_models import tiny_config

    with pytest.raises(UnsupportedModelError, match=match):
        parse_spec({**tiny_config(family).to_dict(), **change})


def test_an_expert_not_of_the_configs_shape_is_refused(tmp_path):
    build_tiny("mixtral", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["intermediate_size"] = 40  # the checkpoint's experts are 48 wide
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"gate_up_proj is \(96, 64\), config.json implies \(80, 64\)"):
        convert(tmp_path / "hf", tmp_path / "store", progress=False)
    assert not (tmp_path / "store").exists()
