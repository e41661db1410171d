"""bench/gpu/micro.py's stages that run without a GPU: the host CPU's expert compute (its `cpu_error` on the
2026-11-30 H200 run was a keyword the timing helper had lost), on a tiny shape."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import micro  # noqa: E402


def test_the_host_cpus_expert_compute_is_timed_warm_and_cold():
    out = micro.cpu_compute(h=64, i=32, cold=3)
    timed = {k: v for k, v in out.items() if k.endswith("_s")}
    assert out["cpu_threads"] >= 1 and len(timed) == 4  # (the native kernels' and torch's, warm and cold)
    assert all(0 < v < 1 for v in timed.values()), timed


def test_each_cuda_call_the_engine_makes_is_timed_by_host_times_names(monkeypatch):
    """On the CPU with host_time.py's stand-ins (their calls counted): every call is made and timed."""
    import host_time
    import torch

    for name in ("Event", "Stream", "current_stream", "stream"):  # (stood in for the process: put back after)
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))
    made = host_time.stand_in_cuda()
    got = micro.cuda_calls(sync=lambda: None)["cuda_call_host_s"]
    assert set(got) == set(made.counts) == {"event.record", "event.query", "event.synchronize", "stream.wait_event",
                                            "stream switch", "event.elapsed_time"}
    assert all(0 < v < 1e-3 for v in got.values())
