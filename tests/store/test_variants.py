"""Quantized copies in a store: written by `convert --precisions` or added by `quantize`, checksummed, resumable."""

import json
import shutil

import pytest
import torch

from moetier.errors import StoreError
from moetier.quant.codes import dequantize, expert_matrices, quantize
from moetier.store import variants
from moetier.store.convert import convert
from moetier.store.format import Manifest
from moetier.store.store import Store
from moetier.store.variants import add_precisions, parse_precisions, require_precisions


@pytest.fixture
def store_copy(tiny_store, tmp_path):
    _, path = tiny_store("olmoe", dtype=torch.bfloat16)
    dest = tmp_path / "store"
    shutil.copytree(path, dest)
    return dest


def test_added_copies_are_the_quantized_native_experts(store_copy):
    assert add_precisions(store_copy, "bf16,int8,int4", progress=False) == ["int8", "int4"]
    store = Store(store_copy)
    assert set(store.manifest.precisions) == {"bf16", "int8", "int4"}
    for precision in ("int8", "int4"):
        for layer in store.spec.moe_layers:
            for e in (0, store.spec.num_experts - 1):
                native = store.read_expert(layer, e)  # checksums verified on read
                got = expert_matrices(store.read_expert(layer, e, precision), precision)
                for name, w in native.items():
                    assert torch.equal(dequantize(got[name]), dequantize(quantize(w, precision)))
    assert not list(store_copy.glob("experts/*/*.json"))  # no sidecar left once the manifest names the blobs
    assert add_precisions(store_copy, "int4", progress=False) == []  # already there: nothing to do


def test_convert_with_precisions_writes_what_quantize_adds(tiny_store, tmp_path, store_copy):
    _, path = tiny_store("olmoe", dtype=torch.bfloat16)
    hf = path.parent / "hf"
    both = Manifest.load(convert(hf, tmp_path / "both", progress=False, precisions="bf16,int2"))
    add_precisions(store_copy, "int2", progress=False)
    added = Manifest.load(store_copy)
    crcs = lambda m: sorted((b.layer, b.expert, b.precision, b.crc32) for b in m.blobs)  # noqa: E731
    assert crcs(both) == crcs(added)


def test_a_killed_run_resumes_and_keeps_finished_layers(store_copy, monkeypatch):
    real = variants.quantize_expert
    calls = []

    def dies_in_the_second_layer(tensors, precision, formats=None):
        calls.append(precision)
        if len(calls) > Store(store_copy).spec.num_experts:
            raise KeyboardInterrupt
        return real(tensors, precision, formats)

    monkeypatch.setattr(variants, "quantize_expert", dies_in_the_second_layer)
    with pytest.raises(KeyboardInterrupt):
        add_precisions(store_copy, "int4", progress=False)
    assert "int4" not in Manifest.load(store_copy).precisions  # readers see the store as it was
    assert list(store_copy.glob("experts/int4/layer_*.json")) and not list(store_copy.glob("experts/int4/.*tmp*"))

    counted = []
    monkeypatch.setattr(variants, "quantize_expert", lambda t, p, f=None: counted.append(p) or real(t, p, f))
    add_precisions(store_copy, "int4", progress=False)
    store = Store(store_copy)
    assert len(counted) == store.spec.num_experts  # only the unfinished layer was quantized again
    for layer in store.spec.moe_layers:
        store.read_expert(layer, 3, "int4")


def test_a_sidecar_that_does_not_match_its_file_is_redone(store_copy, monkeypatch):
    monkeypatch.setattr(Manifest, "save", lambda self, d: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        add_precisions(store_copy, "int8", progress=False)
    monkeypatch.undo()
    side = sorted(store_copy.glob("experts/int8/layer_*.json"))[0]
    d = json.loads(side.read_text())
    d["file_bytes"] += 1
    side.write_text(json.dumps(d))
    counted = []
    real = variants.quantize_expert
    monkeypatch.setattr(variants, "quantize_expert", lambda t, p, f=None: counted.append(p) or real(t, p, f))
    add_precisions(store_copy, "int8", progress=False)
    assert len(counted) == Store(store_copy).spec.num_experts


@pytest.mark.parametrize("text, match", [("int3", "unknown or unavailable precision 'int3'"),
                                         ("fp16", "this store's experts are bf16"), (" , ", "no precision given")])
def test_bad_precisions_are_refused(text, match):
    with pytest.raises(StoreError, match=match):
        parse_precisions(text, "bf16")


def test_a_missing_precision_is_named_with_the_command_that_adds_it(store_copy):
    with pytest.raises(StoreError, match="not int4") as e:
        require_precisions(Store(store_copy), ["bf16", "int4"])
    assert "moetier quantize" in e.value.hint
