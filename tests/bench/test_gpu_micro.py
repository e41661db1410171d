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
