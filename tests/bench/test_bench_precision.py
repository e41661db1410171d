"""bench/bench_precision.py: a mode the budget cannot hold is a row that says so, the others are measured, and
earlier runs' JSON files draw one frontier."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from moetier.store.convert import convert
from tests.tiny_models import build_tiny

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_precision.py"


def test_a_mode_the_budget_cannot_hold_is_a_row_and_the_sweep_goes_on(tmp_path):
    build_tiny("olmoe", tmp_path / "hf", dtype=torch.bfloat16)
    model = tmp_path / "store"
    convert(tmp_path / "hf", model, progress=False, precisions="int4,int2")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(SCRIPT), "--models", str(model), "--budgets", "25%", "--configs",
                        "native,int4,low-tier", "--rounds", "1", "--tokens", "2", "--warmup-tokens", "1",
                        "--prompt-len", "4", "--no-quality", "--out", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    rows = {row["config"]: row for row in json.loads((out / "precision.json").read_text())["rows"]}
    assert "low-tier keeps every expert resident" in rows["low-tier"]["refused"]
    assert rows["native"]["tpot_s"] > 0 and rows["int4"]["tpot_s"] > 0 and "refused" not in rows["int4"]
    assert "does not run" in r.stdout and (out / "precision.png").stat().st_size > 0
    drawn = subprocess.run([sys.executable, str(SCRIPT), "--report", str(out / "precision.json"), "--out",
                            str(tmp_path / "frontier")], capture_output=True, text=True, timeout=120)
    assert drawn.returncode == 0, drawn.stderr
    assert (tmp_path / "frontier" / "frontier.png").stat().st_size > 0
    assert len(json.loads((tmp_path / "frontier" / "frontier.json").read_text())["rows"]) == 3
