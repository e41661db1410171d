"""bench/gpu/host_time.py: the GPU path's host time a MoE layer, on the CPU with CUDA's calls stood in for."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import host_time  # noqa: E402


def test_each_mode_is_timed_on_the_gpu_path_and_summarised(tmp_path, monkeypatch):
    import torch

    from moetier.engine import expert_executor

    for name in ("Event", "Stream", "current_stream", "stream"):  # (stood in for the process: put back after)
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))
    monkeypatch.setattr(expert_executor, "route_arrays_with", expert_executor.route_arrays_with)
    out = tmp_path / "host.json"
    assert host_time.main(["--out", str(out), "--modes", "lru,hobbit", "--tokens", "2", "--warmup", "1",
                           "--rounds", "1", "--cache", str(tmp_path), "--layers", "2", "--experts", "16"]) == 0
    got = json.loads(out.read_text())
    assert [(s["mode"], s["budget"]) for s in got["summary"]] == [("lru", "25%"), ("hobbit", "25%"), ("lru", "100%")]
    assert all(s["host_ms_per_layer"] > 0 and s["host_cpu_ms_per_layer"] > 0 for s in got["summary"])
    calls = {(s["mode"], s["budget"]): s["cuda_calls_per_layer"] for s in got["summary"]}
    assert calls[("lru", "25%")] > calls[("lru", "100%")] >= 0  # (each load's copy: its events, its stream switch)
    rows = {(r["mode"], r["budget"]): r for r in got["rows"]}
    assert rows[("lru", "25%")]["loads"] > 0  # (the engine loaded through the host tier's stood-in copies)
    by_name = rows[("lru", "25%")]["cuda_calls_by_name_per_layer"]
    assert "event.record" in by_name and sum(by_name.values()) == calls[("lru", "25%")]
    # the host waited for each layer's routing as on a GPU: on-demand LRU's copy queue (FIFO) synchronizes the
    # compute stream once a layer (where the routing's copy back would wait)
    assert by_name["stream.synchronize"] >= 1
    assert got["layers"] == 2 and rows[("lru", "25%")]["prefetches"] == rows[("lru", "25%")]["host_runs"] == 0


def test_a_mode_that_needs_a_gpu_or_is_unknown_is_refused(tmp_path, capsys):
    assert host_time.main(["--out", str(tmp_path / "x.json"), "--modes", "cuda-graphs"]) == 1
    assert "not measured here: cuda-graphs" in capsys.readouterr().err
    assert host_time.main(["--out", str(tmp_path / "x.json"), "--modes", "lru,nope"]) == 1
    assert "unknown mode nope (one of lru," in capsys.readouterr().err
    assert host_time.main(["--out", str(tmp_path / "x.json"), "--experts", "4"]) == 1
    assert "at least 8 experts" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_the_triton_path_is_timed_with_its_launches_stood_in_for_and_counted(tmp_path, monkeypatch):
    """`--kernels triton`: the device's experts through TritonExperts (its table built, its two kernels stood in for,
    each launch counted), the host lane's on the CPU's kernels as on a GPU: a call is a table copy and two launches,
    and at 100% the resident path's calls are Triton's too."""
    import torch

    from moetier.engine import expert_executor

    for name in ("Event", "Stream", "current_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))
    monkeypatch.setattr(expert_executor, "route_arrays_with", expert_executor.route_arrays_with)
    out = tmp_path / "host.json"
    assert host_time.main(["--out", str(out), "--modes", "lru,cpu-offload", "--tokens", "2", "--warmup", "1",
                           "--rounds", "1", "--cache", str(tmp_path), "--layers", "2", "--experts", "16",
                           "--kernels", "triton"]) == 0
    got = json.loads(out.read_text())
    assert got["kernels"] == "triton"
    rows = {(r["mode"], r["budget"]): r["cuda_calls_by_name_per_layer"] for r in got["rows"]}
    lru = rows[("lru", "25%")]
    assert lru["triton launch"] >= 2 and lru["triton launch"] == 2 * lru["table copy"]  # (a call: its pair)
    assert rows[("lru", "100%")]["triton launch"] >= 2  # (the resident path's calls go to Triton too)
    offload = next(r for r in got["rows"] if r["mode"] == "cpu-offload")
    assert offload["host_runs"] > 0  # (its misses computed on the host lane, on the CPU's kernels)
