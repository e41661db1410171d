"""bench/gpu/gpu_profile.py: the GPU machine as a simulator profile, made from one GPU run's results — the committed
h200-pcie5 profile again from the run it was made by hand from, and Triton's fused layer taken where measured."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import gpu_profile  # noqa: E402

from moetier.sim.profile import HardwareProfile  # noqa: E402

RUN = ROOT / "bench" / "gpu" / "results" / "2026-11-27-h200"


def test_the_h200_profile_is_made_again_from_its_run(tmp_path):
    made = gpu_profile.build(RUN, "h200-again", 0.1246e-3, 0.209e-3, 0.073e-3, 2e12)
    made.save(tmp_path / "h200-again.json")
    made = HardwareProfile.load(tmp_path / "h200-again.json")  # (what it wrote reads back)
    kept = HardwareProfile.load("h200-pcie5")
    assert made.fast_tier_bytes == kept.fast_tier_bytes and made.compute_device == "gpu"
    for a, b in zip(made.tiers, kept.tiers, strict=True):
        assert a.bandwidth_bytes_per_s == pytest.approx(b.bandwidth_bytes_per_s, rel=1e-3)
        assert a.latency_s == pytest.approx(b.latency_s, abs=1e-6) and a.per_read_s == b.per_read_s
    for name, dev in kept.devices.items():
        assert made.devices[name].memory_bandwidth_bytes_per_s == pytest.approx(dev.memory_bandwidth_bytes_per_s,
                                                                                 rel=2e-3)
        assert made.devices[name].call_overhead_s == pytest.approx(dev.call_overhead_s, rel=1e-2)
    assert len(made.measured) == len(kept.measured) == 8  # two shapes (demo-fine-xl's, OLMoE's), four precisions
    for m in kept.measured:
        again = made.measured_for(m.hidden_size, m.moe_intermediate_size, m.precision)
        for tokens in (1, 8):
            assert again.expert_s(tokens) == pytest.approx(m.expert_s(tokens), rel=1e-3)
        assert again.dense_s_per_layer(1) == pytest.approx(m.dense_s_per_layer(1), rel=1e-3)
    assert made.executor_s_per_layer(1) == kept.executor_s_per_layer(1)


def test_a_layers_experts_in_one_launch_pair_price_an_expert_where_measured():
    micro = json.loads((RUN / "micro.json").read_text())
    micro["gpu_layer8_int4_T1_s"] = 80e-6  # Triton's two launches for 8 experts
    points, why = gpu_profile.expert_points(micro, "int4")
    assert points[0] == [1.0, 10e-6] and "launch pair" in why
    assert points[1][1] == pytest.approx(10e-6 * micro["gpu_expert_int4_T8_s"] / micro["gpu_expert_int4_T1_s"],
                                         rel=1e-3)
    points, why = gpu_profile.expert_points(micro, "int8")  # no layer measured at int8: one expert
    assert points[0][1] == pytest.approx(micro["gpu_expert_int8_T1_s"], rel=1e-3) and "one expert" in why


def test_a_card_with_no_figures_is_refused():
    with pytest.raises(SystemExit, match="no figures for a 'NVIDIA A100'"):
        gpu_profile.card("NVIDIA A100")


def test_a_precision_micro_did_not_time_is_refused():
    micro = json.loads((RUN / "micro.json").read_text())
    del micro["gpu_expert_int2_T1_s"]
    with pytest.raises(SystemExit, match="no int2 expert"):
        gpu_profile.expert_points(micro, "int2")


def test_the_fit_is_the_gap_over_the_loads_and_a_row_not_there_is_refused():
    import sim_check

    out = [{"mode": "lru", "budget": "25%", "real_tpot_s": 0.073, "sim_tpot_s": 0.060, "sim_loads_per_token": 100.0}]
    kept = HardwareProfile.load("h200-pcie5")  # (its per_read_s: 0.1246 ms)
    assert "-> 0.2546 ms" in sim_check.fitted("lru:25%", out, kept)  # 0.1246 + 13 ms / 100 loads
    with pytest.raises(SystemExit, match="no row lru:50%"):
        sim_check.fitted("lru:50%", out, kept)


def test_a_run_whose_cpu_part_failed_takes_the_host_cpu_from_another_run_or_says_so(tmp_path):
    failed = ROOT / "bench" / "gpu" / "results" / "2026-11-30-h200"  # (micro.py's CPU part raised there)
    assert "cpu_expert_bf16_T1_native_cold_s" not in json.loads((failed / "micro.json").read_text())
    with pytest.raises(SystemExit, match="no host-CPU expert .*median_time.*--cpu-from"):
        gpu_profile.build(failed, "h200-later", 0.0, 0.209e-3, 0.073e-3, 2e12)
    made = gpu_profile.build(failed, "h200-later", 0.0, 0.209e-3, 0.073e-3, 2e12, cpu_from=RUN)
    kept = HardwareProfile.load("h200-pcie5")  # (priced its host CPU from RUN's micro.json)
    assert made.devices["cpu"].memory_bandwidth_bytes_per_s == pytest.approx(
        kept.devices["cpu"].memory_bandwidth_bytes_per_s, rel=2e-3)
    assert any("this run's CPU part failed" in line for line in made.sources)
    # the profile docs/gpu.md holds the 2026-11-30 rows to, made again from its command line's figures: the same
    fitted = gpu_profile.build(failed, "h200-pcie5-2026-11-30", 0.0639 / 1e3, 0.209 / 1e3, 0.073 / 1e3, 2e12,
                               cpu_from=RUN)
    fitted.save(tmp_path / "again.json")
    again, kept = (json.loads(path.read_text()) for path in (tmp_path / "again.json",
                                                             failed / "h200-pcie5-2026-11-30.json"))
    assert {k: v for k, v in again.items() if k != "sources"} == {k: v for k, v in kept.items() if k != "sources"}
    (tmp_path / "micro.json").write_text(json.dumps({"device": "NVIDIA H200"}))
    with pytest.raises(SystemExit, match="no host-CPU expert either"):
        gpu_profile.host_expert({}, failed, tmp_path)


def host_time_file(path: Path, rows: list[tuple[str, str, float, float, int, int]], tokens: int = 10) -> Path:
    """host_time.py's JSON over 2 layers: (mode, budget, ms a layer, CUDA calls a layer, loads, prefetches)."""
    path.write_text(json.dumps({"tokens": tokens, "layers": 2, "rows": [
        {"mode": m, "budget": b, "host_ms_per_layer": ms, "cuda_calls_per_layer": calls, "loads": loads,
         "prefetches": pf} for m, b, ms, calls, loads, pf in rows]}))
    return path


def test_the_host_thread_from_host_time_rows(tmp_path):
    """lru at 1 and 3 copies a layer (20 and 60 over 10 tokens x 2 layers) costs 0.3 and 0.5 ms with 10 and 30 CUDA
    calls at 10 us: 0.4 and 0.8 ms, so 0.2 ms a copy and 0.2 at none, less lru at 100% (0.1): launch 0.1 ms. HOBBIT
    at 2 copies costs 0.9 ms (0.3 beyond the line), a prefetcher 0.7 at 3 copies of its own (0 beyond it, less the
    predictor's 0.05: 0), all times 2."""
    import host_figures

    files = [host_time_file(tmp_path / "a.json", [("lru", "10%", 0.3, 10, 20, 0), ("lru", "100%", 0.1, 0, 0, 0),
                                                  ("hobbit", "10%", 0.7, 20, 40, 0)]),
             host_time_file(tmp_path / "b.json", [("lru", "50%", 0.5, 30, 60, 0),
                                                  ("prefetch-hobbit", "10%", 0.7, 10, 0, 60)])]
    issue, lines = host_figures.host_issue(files, 10e-6, 2.0, 0.05e-3, gpu_profile.mode_keys)
    assert issue.load_s == pytest.approx(0.4e-3) and issue.launch_s == pytest.approx(0.2e-3) and issue.plan_s == 0
    assert issue.mechanism_s["precision:hobbit"] == pytest.approx(0.6e-3)
    assert issue.mechanism_s["prefetch:hobbit"] == 0.0  # (-0.05 ms: read as none)
    assert "lru's rows 1.00 copies 0.400 ms, 3.00 copies 0.800 ms" in "\n".join(lines)
    with pytest.raises(SystemExit, match="lru at two budgets below 100%"):
        host_figures.host_issue(files[:1], 10e-6, 1.0, 0.0, gpu_profile.mode_keys)


def test_a_profile_with_the_host_thread_and_the_scale_that_fits_a_row(tmp_path):
    import sim_check

    files = [host_time_file(tmp_path / "a.json", [("lru", "10%", 0.3, 0, 20, 0), ("lru", "50%", 0.5, 0, 60, 0),
                                                  ("lru", "100%", 0.1, 0, 0, 0)])]
    made = gpu_profile.build(ROOT / "bench" / "gpu" / "results" / "2026-11-30-h200", "h200-host", 0.0, 0.209e-3,
                             0.073e-3, 2e12, cpu_from=RUN, host_time=files, call_s=0.0)
    assert made.host_issue.load_s == pytest.approx(0.1e-3) and made.host_issue.launch_s == pytest.approx(0.1e-3)
    assert any(line.startswith("host_issue from host_time.py") for line in made.sources)
    row = {"mode": "lru", "budget": "25%", "batch": 1, "tier": "host", "tpot_s": 0.05}
    # a simulation whose step is 10 ms plus 100 launches: 20 ms at the profile's figures, 50 at 4 times them
    simulated = lambda r, p: {"sim_tpot_s": 0.01 + 100 * p.host_issue.launch_s}  # noqa: E731
    assert "times 4.000 bring it to 50.00 ms" in sim_check.host_scale("lru:25%", [row], made, simulated)
    with pytest.raises(SystemExit, match="no row lru:50%"):
        sim_check.host_scale("lru:50%", [row], made, simulated)


def test_a_rows_cuda_calls_priced_by_name_where_micro_timed_them(tmp_path):
    import host_figures

    path = host_time_file(tmp_path / "a.json", [("lru", "10%", 0.3, 3, 20, 0)])
    d = json.loads(path.read_text())
    d["rows"][0]["cuda_calls_by_name_per_layer"] = {"event.record": 2, "stream switch": 1}
    path.write_text(json.dumps(d))
    (row,) = host_figures.rows_of([path], 10e-6, {"event.record": 1e-6}).values()
    assert row["host_s"] == pytest.approx(0.3e-3 + 2 * 1e-6 + 10e-6) and row["copies"] == 1.0
    (row,) = host_figures.rows_of([path], 10e-6).values()  # (no names timed: each call at call_s)
    assert row["host_s"] == pytest.approx(0.3e-3 + 3 * 10e-6)


def test_bad_host_options_are_refused_in_one_line_before_anything_is_read(tmp_path, monkeypatch, capsys):
    out = tmp_path / "p.json"
    for extra, said in ((["--host-time", str(tmp_path / "none.json")], "no file"),
                        (["--host-scale", "0"], "--host-scale must be > 0")):
        monkeypatch.setattr(sys, "argv", ["gpu_profile.py", str(RUN), "--name", "x", "--out", str(out), *extra])
        with pytest.raises(SystemExit) as e:
            gpu_profile.main()
        assert e.value.code == 1
        assert capsys.readouterr().err.startswith(f"gpu_profile: error: {said}") and not out.exists()
