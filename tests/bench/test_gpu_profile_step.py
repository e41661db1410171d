"""bench/gpu/profile_step.py's reading of a trace and its host profile, on the CPU."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import profile_step  # noqa: E402


def event(cat: str, stream: int, start_us: float, dur_us: float, nbytes: int = 0) -> dict:
    return {"ph": "X", "cat": cat, "ts": start_us, "dur": dur_us, "args": {"stream": stream, "bytes": nbytes}}


def test_a_trace_says_how_long_the_device_waited_on_the_host():
    """Two kernels on the compute stream and a copy overlapping the second, over a 100 us span: busy 0-20 and
    50-90, idle 40% of it; the copy overlaps 20 of its 30 us."""
    trace = {"traceEvents": [event("kernel", 7, 0, 20), event("kernel", 7, 50, 20), event("gpu_memcpy", 13, 60, 30,
                                                                                          1 << 20),
                             event("kernel", 7, 99, 1)]}
    got = profile_step.summarize(trace, wall_s=1e-4, steps=1)
    assert got["compute_stream"] == 7 and got["copy_streams"] == [13]
    assert got["device_idle_share"] == pytest.approx(0.39)  # (busy 0-20, 50-90, 99-100 of 0-100)
    assert got["overlap_s"] == pytest.approx(10e-6) and got["copy_busy_s"] == pytest.approx(30e-6)


def test_the_host_profile_names_where_a_step_spends_its_time(tiny_store):
    from moetier import Engine

    _, path = tiny_store("olmoe", num_hidden_layers=2)
    with Engine.from_pretrained(path, expert_memory="50%", progress=False) as engine:
        engine.generate([[5, 6, 7]], max_new_tokens=2, ignore_eos=True)
        got = profile_step.host_functions(engine, [7], steps=3, top=5)
    assert got["tpot_s"] > 0 and len(got["by_own_time"]) == len(got["by_time_with_callees"]) == 5
    names = [row["function"] for row in got["by_time_with_callees"]]
    assert any("generate" in name for name in names), names  # (the call itself holds the most, with its callees)
    assert all(row["own_ms_per_step"] >= 0 and row["calls_per_step"] > 0 for row in got["by_own_time"])
