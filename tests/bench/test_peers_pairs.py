"""bench/peers/compare.py --pairs: each round's ratio pairs the two engines of that round (not the medians of a
row, which on a host whose memory speed moves can pair a fast run with a slow one)."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "peers" / "compare.py"


def load_compare():
    spec = importlib.util.spec_from_file_location("peers_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers_compare"] = module
    spec.loader.exec_module(module)
    return module


def run(fmt, engine, rnd, tok_s):
    return dict(format=fmt, setting="resident", engine=engine, round=rnd, tok_s=tok_s)


def test_each_round_pairs_its_own_two_runs(tmp_path):
    compare = load_compare()
    # round 0 on a fast host, round 1 on a slow one: the medians (15 vs 15) would say 1.0, the rounds 0.9 and 0.9
    done = {"meta": {"threads": 2, "cpu": {"model": "test"}},
            "runs": [run("bf16", "llama.cpp", 0, 20.0), run("bf16", "native", 0, 18.0),
                     run("bf16", "llama.cpp", 1, 10.0), run("bf16", "native", 1, 9.0),
                     run("q4_k_m", "llama.cpp", 0, 40.0), dict(run("q4_k_m", "int4", 0, 0), error="killed")]}
    del done["runs"][-1]["tok_s"]  # (a failed run has no speed: its round has no ratio)
    ratios = compare.round_ratios(done)
    assert ratios == {("bf16", "resident", "native"): [0.9, 0.9]}
    md = compare.plot_pairs({"a-run": done}, tmp_path / "pairs.png", "title")
    assert "0.90 0.90 (**0.90**)" in md and (tmp_path / "pairs.png").stat().st_size > 0
