"""`moetier doctor` on shipped shapes and hand-checked numbers: what fits, the least budget, a cell per mode and
budget, gates drawn as routers give them, and bad input refused in one line."""

import json

import numpy as np
import pytest

from moetier.cli import main
from moetier.cli.models import model_shape
from moetier.sim.doctor import BUDGETS, LOCALITY, MODES, RUNTIME_BYTES, TOP_K_MASS, diagnose, with_gates
from moetier.sim.profile import HardwareProfile
from moetier.trace.synthetic import generate


@pytest.fixture(scope="module")
def mixtral_on_4090():
    shape, _ = model_shape("mixtral-8x7b")
    return diagnose(shape, HardwareProfile.load("rtx4090"), tokens=40)


def test_the_plan_says_what_fits_and_the_least_budget(mixtral_on_4090):
    plan = mixtral_on_4090
    assert not plan["fits_resident"] and plan["runs_at_all"]  # 84 GiB of experts against a 24 GB card
    assert plan["least_budget_bytes"] == 2 * plan["expert_each_bytes"]  # one layer's top-2
    assert [(c["mode"], c["budget"]) for c in plan["cells"]] == [(m, b) for m in MODES for b in BUDGETS]
    cells = {(c["mode"], c["budget"]): c for c in plan["cells"]}
    assert cells["exact", "100%"]["tpot_s"] is None and "does not fit" in cells["exact", "100%"]["why"]
    assert cells["exact", "10%"]["tpot_s"] > 0
    assert cells["exact", "auto"]["memory_bytes"] - RUNTIME_BYTES <= plan["fast_tier_bytes"]
    # HOBBIT reads int4 copies of the less important misses: faster than exact at the same budget
    assert cells["hobbit", "auto"]["tpot_s"] < cells["exact", "auto"]["tpot_s"]
    assert plan["notes"] == []  # a paper's machine, no disk timed on some other model's reads


def test_a_small_model_fits_resident_and_is_fastest_there():
    shape, _ = model_shape("olmoe-1b-7b")
    plan = diagnose(shape, HardwareProfile.load("a100-epyc"), tokens=32)
    assert plan["fits_resident"]
    exact = [c for c in plan["cells"] if c["mode"] == "exact" and c["tpot_s"] is not None]
    assert min(exact, key=lambda c: c["tpot_s"])["budget"] in ("100%", "auto")


def test_drawn_gates_are_sorted_shares_with_full_scores_below_the_kth():
    shape, _ = model_shape("qwen1.5-moe-a2.7b")
    t = generate(LOCALITY, shape.num_layers, shape.num_experts, shape.top_k, 50, layers=list(shape.moe_layers))
    g = with_gates(t, np.random.default_rng(0))
    w = g.topk_weights.astype(np.float32)
    assert np.all(np.diff(w, axis=-1) <= 1e-3) and np.allclose(w.sum(-1), TOP_K_MASS, atol=1e-2)
    s = g.scores.astype(np.float32)
    top = np.take_along_axis(s, g.topk_ids.astype(np.int64), axis=-1)
    assert np.allclose(top, w, atol=1e-3)
    s_masked = s.copy()
    np.put_along_axis(s_masked, g.topk_ids.astype(np.int64), -1.0, axis=-1)
    assert (s_masked.max(-1) < top.min(-1)).all()  # every other expert below the k-th


def test_the_command_reads_a_config_json_and_prints_json(tmp_path, capsys):
    import shutil
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "models" / "demo-deep" / "config.json"
    (tmp_path / "m").mkdir()
    shutil.copy(src, tmp_path / "m" / "config.json")
    assert main(["doctor", str(tmp_path / "m" / "config.json"), "--profile", "rtx4060ti", "--json",
                 "--tokens", "16"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits_resident"] and plan["profile"] == "rtx4060ti"


def test_bad_input_is_one_line(capsys):
    assert main(["doctor", "no-such-model", "--profile", "rtx4090"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moetier: error: no model shape 'no-such-model'") and "hint" in err
    assert main(["doctor", "mixtral-8x7b", "--profile", "no-such-profile"]) == 1
    assert "no hardware profile" in capsys.readouterr().err


def test_a_bad_fit_trace_or_precision_is_refused_before_any_calibration(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOETIER_CACHE", str(tmp_path / "cache"))  # no this-machine profile there
    assert main(["doctor", "mixtral-8x7b", "--fit", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert "is not a trace" in err and "calibrating" not in err
    assert main(["doctor", "mixtral-8x7b", "--precision", "fp7"]) == 1
    assert "unknown precision 'fp7'" in capsys.readouterr().err
    assert not (tmp_path / "cache" / "profiles").exists()
