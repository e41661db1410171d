"""Inflated stores compute what their model computes: the padding is exact (random gate/up rows, zero down
columns), logits agree, greedy tokens and recorded routing are the same, and the built-in `-xl` names build once."""

import json

import numpy as np
import pytest
import torch

from moetier import atomic
from moetier.engine.engine import Engine
from moetier.errors import MoetierError
from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.resolve import resolve_model
from moetier.store import inflate as inflate_module
from moetier.store.inflate import inflate
from moetier.store.store import Store
from moetier.trace.record import TraceRecorder

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


def logits(store, ids: list[int]) -> torch.Tensor:
    with Engine.from_pretrained(store, expert_memory="100%", progress=False) as engine:
        kv = KVCache(engine.spec, 1, len(ids), engine.model.dtype)
        return engine.model.forward(StepBatch.prefill([ids], [0]), kv, all_logits=True).float()  # [T, V]


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_is_exact_and_logits_agree(tiny_store, family, tmp_path):
    _, small = tiny_store(family)
    big = inflate(small, tmp_path / "xl", 200, progress=False)
    a, b = Store(small), Store(big)
    assert b.spec.moe_intermediate_size == 200 and a.spec.moe_intermediate_size == 48
    assert b.native_layout.blob_bytes > 4 * a.native_layout.blob_bytes
    old, new = a.read_expert(0, 3), b.read_expert(0, 3)
    assert torch.equal(new["gate_up_proj"][:48], old["gate_up_proj"][:48])  # gate
    assert torch.equal(new["gate_up_proj"][200:248], old["gate_up_proj"][48:])  # up
    assert new["gate_up_proj"][48:200].abs().sum() > 0  # random rows: real bytes to read
    assert torch.equal(new["down_proj"][:, :48], old["down_proj"]) and not new["down_proj"][:, 48:].any()
    ids = torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    # fp32 stores: only the order of a longer reduction differs
    torch.testing.assert_close(logits(big, ids), logits(small, ids), atol=1e-4, rtol=1e-4)


def test_a_trained_bf16_model_inflated_writes_the_same_tokens_and_routing(tmp_path):
    small = resolve_model("demo-fine", progress=False)
    big = inflate(small, tmp_path / "xl", 512, progress=False)  # 4x its experts (8192 is the benchmark's)
    prompts = ["It was a fine morning, and", "def read_config(path):\n"]
    traces, texts = [], []
    for store in (small, big):
        with Engine.from_pretrained(store, expert_memory="100%", progress=False) as engine, \
                TraceRecorder(engine) as rec:
            texts.append([engine.generate(p, max_new_tokens=64).texts[0] for p in prompts])
            traces.append(rec.trace(prompts))
    assert texts[0] == texts[1]
    assert np.array_equal(traces[0].topk_ids, traces[1].topk_ids)
    # bf16 weights, fp32 accumulation in a different order: router scores agree to bf16 rounding
    np.testing.assert_allclose(traces[0].scores.astype(np.float32), traces[1].scores.astype(np.float32),
                               atol=2e-2)
    assert traces[1].model == "xl" and traces[0].model == "demo-fine"  # each named by its own folder


def test_inflation_is_refused_when_it_does_not_grow_or_the_disk_is_short(tiny_store, tmp_path, monkeypatch):
    _, small = tiny_store("olmoe")
    with pytest.raises(MoetierError, match="already have intermediate size 48"):
        inflate(small, tmp_path / "same", 48, progress=False)
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(MoetierError, match=r"needs [\d.]+ MiB at .*full; .* has 1000 B free"):
        inflate(small, tmp_path / "full", 4096, progress=False)
    assert not (tmp_path / "same").exists() and not (tmp_path / "full").exists()


def test_builtin_xl_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(inflate_module, "OLMOE_EXPERT_BYTES", 3 * 256 * 1024 * 2)  # a small "real" size
    first = resolve_model("demo-coarse-xl", tmp_path, progress=False)
    assert first.parent == tmp_path and first.name.startswith("demo-coarse-xl-")
    assert Store(first).spec.moe_intermediate_size == 1024
    stamp = (first / "manifest.json").stat().st_mtime_ns
    assert resolve_model("demo-coarse-xl", tmp_path, progress=False) == first
    assert (first / "manifest.json").stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_trace_record_on_an_xl_model_names_it_and_routes_as_the_small_one(tmp_path, monkeypatch, capsys):
    from moetier.cli import main
    from moetier.trace.format import Trace

    monkeypatch.setattr(inflate_module, "OLMOE_EXPERT_BYTES", 3 * 256 * 1024 * 2)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("It was a fine morning, and\ndef read_config(path):\n")
    for name in ("demo-coarse", "demo-coarse-xl"):
        assert main(["trace", "record", "--model", name, "--prompts", str(prompts), "--out", str(tmp_path / name),
                     "--max-tokens", "8", "--cache-dir", str(tmp_path / "cache")]) == 0
    small, big = Trace.load(tmp_path / "demo-coarse"), Trace.load(tmp_path / "demo-coarse-xl")
    assert big.model == "demo-coarse-xl" and np.array_equal(small.topk_ids, big.topk_ids)
    # the simulator takes each model's shape from its trace: same hits, reads of the xl model's 1.5 MiB experts
    sims = {}
    for name in ("demo-coarse", "demo-coarse-xl"):
        capsys.readouterr()
        assert main(["sim", "--trace", str(tmp_path / name), "--profile", "rtx4090", "--expert-memory", "25%",
                     "--cache-dir", str(tmp_path / "cache")]) == 0
        sims[name] = json.loads(capsys.readouterr().out)
    assert sims["demo-coarse-xl"]["model_shape"] == "demo-coarse-xl"
    assert sims["demo-coarse-xl"]["hit_rate"] == sims["demo-coarse"]["hit_rate"]
    blob = {name: Store(resolve_model(name, tmp_path / "cache")).native_layout.blob_bytes for name in sims}
    assert sims["demo-coarse-xl"]["expert_bytes_per_token"] == pytest.approx(
        sims["demo-coarse"]["expert_bytes_per_token"] * blob["demo-coarse-xl"] / blob["demo-coarse"])


def test_an_inflated_store_finds_the_trained_files_of_the_model_it_was_inflated_from(tiny_store, tmp_path):
    _, small = tiny_store("olmoe")
    big = inflate(small, tmp_path / "xl", 200, progress=False)
    assert Store(big).trained_dir("predictors") == big  # none anywhere: beside the store itself
    (small / "predictors").mkdir()
    try:
        assert Store(big).trained_dir("predictors") == small  # same routers, same routing: the base's apply
        (big / "predictors").mkdir()
        assert Store(big).trained_dir("predictors") == big  # its own first
    finally:
        (small / "predictors").rmdir()


@pytest.mark.parametrize("family,why", [("gpt_oss", "pads SwiGLU experts"), ("deepseek_v3", "shared experts are sized")])
def test_families_inflate_cannot_pad_are_refused(tiny_store, tmp_path, family, why):
    _, small = tiny_store(family)
    with pytest.raises(MoetierError, match=why):
        inflate(small, tmp_path / "xl", 200, progress=False)
    assert not (tmp_path / "xl").exists()


def test_quantizing_the_base_model_keeps_its_xl_build(tmp_path, monkeypatch):
    """`moetier quantize demo-deep` adds copies to the base store: the -xl build read none of them and stays
    (it was built again: 9 GiB for demo-deep-xl)."""
    from moetier.store.variants import add_precisions

    monkeypatch.setattr(inflate_module, "OLMOE_EXPERT_BYTES", 3 * 256 * 1024 * 2)
    first = resolve_model("demo-coarse-xl", tmp_path, progress=False)
    base = resolve_model("demo-coarse", tmp_path, progress=False)
    add_precisions(base, "int8", progress=False)
    assert resolve_model("demo-coarse-xl", tmp_path, progress=False) == first and first.exists()


def test_a_rebuild_the_disk_cannot_hold_names_the_older_build_that_could_go(tmp_path, monkeypatch):
    import moetier.resolve as resolve

    monkeypatch.setattr(inflate_module, "OLMOE_EXPERT_BYTES", 3 * 256 * 1024 * 2)
    first = resolve_model("demo-coarse-xl", tmp_path, progress=False)
    monkeypatch.setattr(resolve, "_inflation_key", lambda base: "changed")  # the base's weights changed
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(MoetierError, match="needs") as e:
        resolve_model("demo-coarse-xl", tmp_path, progress=False)
    assert str(first) in e.value.hint and "older build of demo-coarse-xl" in e.value.hint

