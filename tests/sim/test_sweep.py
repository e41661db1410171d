"""`moetier sim` on shipped profiles and named shapes: single runs, sweeps, and the errors a user meets."""

import json

import pytest

from moetier.cli import main
from moetier.errors import MoetierError
from moetier.sim.cost import CostModel
from moetier.sim.profile import HardwareProfile
from moetier.sim.shapes import SHAPES
from moetier.sim.sweep import budget_slots, check_fits, run
from moetier.trace.synthetic import LocalityFit, generate

FIT = LocalityFit(zipf_s=0.8, p_keep=0.4, reuse_next=0.0, source="hand-made")


@pytest.fixture
def mixtral_trace(tmp_path):
    trace = generate(FIT, 32, 8, 2, 60, seed=1, model="mistralai/Mixtral-8x7B-v0.1")
    trace.save(tmp_path / "t")
    return trace, tmp_path / "t"


def test_a_trace_that_does_not_fit_the_shape_is_refused(mixtral_trace):
    trace, _ = mixtral_trace
    with pytest.raises(MoetierError, match="routes top-2 of 8 experts; model shape olmoe-1b-7b has top-8 of 64"):
        check_fits(trace, SHAPES["olmoe-1b-7b"])
    check_fits(trace, SHAPES["mixtral-8x7b"])


def test_a_budget_beyond_the_fast_tier_is_refused(mixtral_trace):
    trace, _ = mixtral_trace
    cost = CostModel.of(HardwareProfile.load("rtx4090"), SHAPES["mixtral-8x7b"])
    with pytest.raises(MoetierError, match="does not fit: the fast tier of rtx4090"):
        budget_slots("75%", trace, cost)
    assert budget_slots("4GiB", trace, cost) == 4 * 2**30 // cost.expert_bytes


def test_more_memory_never_slows_lfu_down_on_a_gpu(mixtral_trace):
    trace, _ = mixtral_trace
    cost = CostModel.of(HardwareProfile.load("a100-epyc"), SHAPES["mixtral-8x7b"])
    runs = [run(trace, cost, "lfu", b) for b in ("10%", "30%", "60%")]
    tpot = [r.result.summary()["tpot_s"] for r in runs]
    hits = [r.result.hit_rate for r in runs]
    assert hits[0] <= hits[1] <= hits[2] and tpot[0] >= tpot[1] >= tpot[2]


def test_a_per_layer_cache_without_a_slot_for_each_layer_is_refused_as_the_engine_refuses_it(mixtral_trace, capsys):
    """10%: 25 slots for 32 layers. Split by layer, seven layers would have none to stream their experts through (the
    replay failed with a LookupError deep in a cell, after the others had run)."""
    trace, path = mixtral_trace
    cost = CostModel.of(HardwareProfile.load("a100-epyc"), SHAPES["mixtral-8x7b"])
    with pytest.raises(MoetierError, match="a per-layer cache needs a slot for each of the 32 MoE layers; the budget "
                                           "gives 25"):
        run(trace, cost, "lru", "10%", partition="per-layer")
    assert run(trace, cost, "lru", "13%", partition="per-layer").slots == 33  # a slot a layer: it runs
    assert run(trace, cost, "lru", "10%").slots == 25  # one cache: streamed through, as ever
    assert main(["sim", "--trace", str(path), "--profile", "a100-epyc", "--policy", "lru,fld", "--expert-memory",
                 "13%,10%", "--cache-partition", "per-layer", "--out", str(path.parent / "sweep")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moetier: error: a per-layer cache needs a slot for each of the 32") and "Traceback" not in err
    assert not (path.parent / "sweep").exists()  # refused before any cell ran


def test_sim_cli_sweep_writes_table_json_and_plot(mixtral_trace, tmp_path, capsys):
    _, path = mixtral_trace
    out = tmp_path / "sweep"
    assert main(["sim", "--trace", str(path), "--profile", "a6000", "--policy", "lru,lfu",
                 "--expert-memory", "10%,25%", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mixtral-8x7b (bf16) on a6000" in text and text.count("%") >= 8
    rows = json.loads((out / "sweep.json").read_text())["runs"]
    assert [(r["policy"], r["expert_memory"]) for r in rows] == [("lru", "10%"), ("lru", "25%"), ("lfu", "10%"),
                                                                  ("lfu", "25%")]
    assert (out / "sweep.png").stat().st_size > 0
    assert main(["sim", "--trace", str(path), "--profile", "a6000", "--model-shape", "qwen3-30b-a3b"]) == 1
    assert "routes top-2 of 8 experts" in capsys.readouterr().err
    assert main(["sim", "--trace", str(path), "--profile", "v100-pcie3"]) == 1
    assert "lists no throughput for bf16" in capsys.readouterr().err


def test_trace_synth_for_a_named_shape(mixtral_trace, tmp_path):
    from moetier.trace.format import Trace

    _, path = mixtral_trace
    assert main(["trace", "synth", "--fit", str(path), "--model-shape", "deepseek-moe-16b", "--tokens", "50",
                 "--out", str(tmp_path / "ds")]) == 0
    made = Trace.load(tmp_path / "ds")
    assert made.layers == list(range(1, 28)) and (made.num_experts, made.top_k) == (64, 6) and made.synthetic
    assert main(["trace", "synth", "--fit", str(path), "--out", str(tmp_path / "x")]) == 1


def test_a_profile_whose_memory_cannot_hold_the_experts_is_refused():
    """CoMoE's NUC has 32 GB of RAM: Switch-Base-256's fp32 experts (58 GB) fit nowhere, its bf16 ones (29 GB) do;
    a profile reading from a disk of no stated size holds anything."""
    from moetier.errors import MoetierError
    from moetier.sim.cost import CostModel
    from moetier.sim.profile import HardwareProfile
    from moetier.sim.shapes import SHAPES
    from moetier.sim.sweep import check_holds

    nuc, shape = HardwareProfile.load("nuc-a500"), SHAPES["switch-base-256"]
    with pytest.raises(MoetierError, match="switch-base-256's experts .* do not fit nuc-a500"):
        check_holds(CostModel.of(nuc, shape, "fp32"))
    check_holds(CostModel.of(nuc, shape, "bf16"))
    check_holds(CostModel.of(HardwareProfile.load("jetson-orin"), shape, "fp32"))


def test_a_cache_smaller_than_a_tokens_experts_says_why_it_hits_nothing(mixtral_trace, tmp_path, capsys):
    """(The first `sim` example of the docs printed a 0% hit rate and no reason; it was LRU's, the default then.)
    The default now keeps some experts there."""
    _, path = mixtral_trace
    assert main(["sim", "--trace", str(path), "--profile", "rtx4090", "--expert-memory", "12GiB", "--policy", "lru"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["hit_rate"] == 0
    assert "note: the cache holds 36 experts and each token needs 64" in err
    assert main(["sim", "--trace", str(path), "--profile", "rtx4090", "--expert-memory", "12GiB"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["hit_rate"] > 0.1 and "note: the cache holds" not in err
    assert main(["sim", "--trace", str(path), "--profile", "rtx4090", "--expert-memory", "12GiB", "--policy",
                 "lfu"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["hit_rate"] > 0 and "note:" not in err


def test_rates_print_in_the_unit_that_shows_them():
    """(calibrate printed a quantized expert's one-token rate as 0.00 TFLOP/s.)"""
    from moetier.cli.sim import flop_rate

    assert flop_rate(2.61e12) == "2.61 TFLOP/s" and flop_rate(7.7e10) == "77.0 GFLOP/s"
    assert flop_rate(1.1e9) == "1.1 GFLOP/s"


def test_pressure_resizes_the_replay_as_simulate_is_told_and_the_cli_reports_it(mixtral_trace, capsys):
    """--pressure 20:10%,40:50%: the cache shrinks before step 20 and grows back before 40, exactly the resizes
    simulate is given; the shrink costs hits against a run that keeps its budget; each order is the one named."""
    from moetier.cache.policies import PolicyContext
    from moetier.sim.pressure import Pressure
    from moetier.sim.replay import simulate, trace_policy

    trace, path = mixtral_trace
    cost = CostModel.of(HardwareProfile.load("a100-epyc"), SHAPES["mixtral-8x7b"])
    pressure = Pressure.parse("20:10%,40:50%")
    small, big = budget_slots("10%", trace, cost), budget_slots("50%", trace, cost)
    pressed, steady = run(trace, cost, "lru", "50%", True, pressure=pressure), run(trace, cost, "lru", "50%", True)
    for shrink in ("offload-priority", "policy"):
        told = simulate(trace, trace_policy("lru", PolicyContext(big, tuple(trace.layers), 8, 2), trace, None), big,
                        cost, cost.precision, True, resizes={20: small, 40: big}, shrink=shrink)
        got = run(trace, cost, "lru", "50%", True, pressure=Pressure.parse("20:10%,40:50%", shrink)).result
        assert (got.hits, got.step_time_s) == (told.hits, told.step_time_s)
    assert pressed.result.hits < steady.result.hits
    assert pressed.row()["pressure"] == [{"step": 20, "expert_memory": "10%", "slots": small},
                                         {"step": 40, "expert_memory": "50%", "slots": big}]
    assert main(["sim", "--trace", str(path), "--profile", "a100-epyc", "--expert-memory", "50%", "--preload",
                 "--pressure", "20:10%,40:50%", "--shrink", "policy"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["shrink"] == "policy" and [p["slots"] for p in row["pressure"]] == [small, big]
