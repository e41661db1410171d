"""bench/alternate_steps.py stays runnable: each feature is turned on and off in alternate steps of one run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetier.model import native
from tests.tiny_models import build_tiny

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "alternate_steps.py"


@pytest.mark.skipif(native.load().lib is None, reason="no native kernels on this machine")
@pytest.mark.parametrize("feature", ["blocks", "tables", "router", "step", "one-token", "hit-layer", "all-hit"])
def test_alternate_steps_measures_both_sides(tmp_path, feature):
    model = tmp_path / "tiny"
    build_tiny("olmoe", model, dtype=torch.bfloat16)
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--feature", feature, "--tokens", "12",
                        "--prompt-len", "4", "--out", str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "out" / "alternate_steps.json").read_text())
    assert result["feature"] == feature and result["pairs"] == result["steps"] // 2 >= 4
    assert result["on_ms"] > 0 and result["off_ms"] > 0 and 0 <= result["faster"] <= result["pairs"]
    assert result["expert_memory"] == ("75%" if feature in ("one-token", "hit-layer", "all-hit") else "100%")


def test_a_batch_is_decoded_together_with_the_feature_alternated(tmp_path):
    model = tmp_path / "tiny"
    build_tiny("olmoe", model, dtype=torch.bfloat16)
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--feature", "hit-layer", "--batch", "3",
                        "--tokens", "14", "--prompt-len", "4", "--out", str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "out" / "alternate_steps.json").read_text())
    assert result["batch"] == 3 and result["pairs"] >= 4


def test_one_token_is_refused_at_a_whole_cache_before_anything_loads(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path / "absent"), "--feature", "one-token",
                        "--expert-memory", "100%"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("moetier: error: at 100% every layer skips planning")
    assert "--feature one-token changes nothing" in r.stderr
