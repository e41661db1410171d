"""bench/profile_decode.py stays runnable: every part it times is still found and called in a decode step (the
layers one by one), and the whole step in one native call is timed as one part where it runs."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.tiny_models import build_tiny

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "profile_decode.py"


def profile(model: Path, out: Path, *options: str) -> list[dict]:
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--tokens", "2", "--prompt-len", "4",
                        "--out", str(out), *options], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads((out / "profile_decode.json").read_text())["runs"]


def test_profile_decode_times_every_part(tmp_path):
    model = tmp_path / "tiny"
    build_tiny("olmoe", model, dtype=torch.bfloat16)
    whole = "whole step (one native call)"
    (run,) = profile(model, tmp_path / "whole", "--kernels", "native")
    assert run["calls"][whole] == 1 and run["calls"]["attention block (one native call)"] == 0
    assert run["calls"]["router"] == 0 and 0 < run["parts"][whole] < run["tpot_s"]
    runs = profile(model, tmp_path / "out", "--kernels", "torch,native", "--layer-by-layer")
    assert [run["kernels"] for run in runs] == ["torch", "native"]
    either = ("  expert matmuls (one by one)", "  expert matmuls (a layer's)", "  expert matmuls (one token's)",
              "  expert matmuls (one token's, table)", "  grouping", "  combine")  # batch 1, resident: one token's
    planned = ("  layer step: begin (plan)", "  layer step: end (accesses)")  # every expert resident: no plan
    block = "attention block (one native call)"
    layered = ("attention (all of it)", "  decode attention", "  rope", "  kv write")  # where there is no block
    for run in runs:
        native = run["kernels"] != "torch"  # (the native kernels: a block a layer, the experts from a table)
        skipped = either + planned + (layered if native else (block,)) + (whole,)
        never = [label for label, calls in run["calls"].items() if calls <= 0 and label not in skipped]
        assert never == [], f"{run['kernels']}: parts never called in a decode step: {never}"
        assert all(run["calls"][label] == 0 for label in planned)
        assert all(run["calls"][label] == 0 for label in ((block,) if not native else layered))
        token = "  expert matmuls (one token's, table)" if native else "  expert matmuls (one token's)"
        assert run["calls"][token] > 0, "the token's experts were not computed at once"
        assert 0 < run["parts"]["moe: the executor (all of it)"] < run["tpot_s"]
