"""bench/bench_serve.py runs end to end on a small model (both servers, every mode, the table and plot), and
bench/batch_overlap.py's union arithmetic is right on hand-made routes."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.serve.conftest import text_store  # noqa: F401 (the fixture)

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_bench_serve_measures_both_modes(tmp_path, text_store):  # noqa: F811
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(BENCH / "bench_serve.py"), "--model", str(text_store), "--expert-memory",
                        "50%", "--concurrency", "1,2", "--requests-per-client", "1", "--tokens", "4",
                        "--max-running", "2", "--max-model-len", "256", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((out / "bench_serve.json").read_text())["rows"]
    assert {(row["mode"], row["concurrency"]) for row in rows} == {(m, c) for m in ("batching", "one-at-a-time")
                                                                    for c in (1, 2)}
    assert all(row["generated"] == 4 * row["concurrency"] and row["tok_s"] > 0 for row in rows)
    assert (out / "bench_serve.png").stat().st_size > 0 and "| 2 | batching |" in (out / "bench_serve.md").read_text()


def test_union_ratio_on_hand_made_routes():
    sys.path.insert(0, str(BENCH.parent))
    from bench.batch_overlap import union_ratio

    same = {(f"s{i}", 0): [[0, 1]] for i in range(4)}  # every sequence routes to the same two experts
    apart = {(f"s{i}", 0): [[2 * i, 2 * i + 1]] for i in range(4)}  # no two share one
    rng = np.random.default_rng(0)
    assert union_ratio(8, 2, same, 4, 5, rng) == 4.0 and union_ratio(8, 2, apart, 4, 5, rng) == 1.0


def test_cache_reads_on_hand_made_routes():
    """LRU, LFU and Belady's MIN count the reads a hand-checked sequence needs, one at a time and in lock step."""
    sys.path.insert(0, str(BENCH.parent))
    from bench.batch_overlap import cache_reads, repeats

    # One sequence cycling 0, 1, 2 through two slots: LRU misses every time; MIN keeps the sooner one (4 reads of 6).
    cycle = {"a": {0: [[0], [1], [2], [0], [1], [2]]}}
    assert cache_reads(cycle, 1, 2, "lru") == 1.0 and cache_reads(cycle, 1, 2, "belady") == 4 / 6
    # Two sequences that each keep to one expert: alone, one read each (the second evicts the first: 2 of 8
    # tokens); together, each step's union of two streams through one slot: two reads a step, one a token.
    apart = {"a": {0: [[0]] * 4}, "b": {0: [[1]] * 4}}
    for policy in ("lru", "lfu", "belady"):
        assert cache_reads(apart, 1, 1, policy) == 2 / 8 and cache_reads(apart, 2, 1, policy) == 1.0
    # Two sequences on the same expert: together they share every read (one in all), alone the second hits.
    same = {"a": {0: [[3]] * 4}, "b": {0: [[3]] * 4}}
    assert cache_reads(same, 2, 1, "lru") == 1 / 8 == cache_reads(same, 1, 1, "lru")
    assert repeats({("a", 0): [[1], [1], [2], [2]]}) == 2 / 3
