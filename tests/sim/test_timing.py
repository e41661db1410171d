"""The simulator's clock on hand-made plans with round numbers."""

import numpy as np
import pytest

from moetier.plan.layer_plan import Hit, LayerPlan, Load
from moetier.plan.route import RouteResult
from moetier.sim.profile import HardwareProfile, Linear, Link, ProfileError
from moetier.sim.timing import time_layer

PROFILE = HardwareProfile("unit", 10**9, Link(bandwidth_bytes_per_s=100.0), expert_compute=Linear(0.0, 1.0),
                          dense_s_per_layer=Linear(0.0, 2.0), head_s=Linear(0.0, 0.0))


def plan(hits, loads, counts):
    route = RouteResult(0, 1, np.zeros((1, 1), np.int64), np.zeros((1, 1), np.float32), np.zeros((1, 4), np.float32))
    return LayerPlan(route, np.asarray(counts), sorted([h.expert for h in hits] + [ld.expert for ld in loads]),
                     hits, loads)


def test_reads_are_serial_and_overlap_resident_compute():
    # dense 2 s; hits 0 and 1 compute 1 s each (2-4 s); two reads of 300 bytes at 100 B/s: 2-5 s and 5-8 s
    p = plan([Hit(0, 0), Hit(1, 1)], [Load(2, 2), Load(3, 3)], [1, 1, 1, 1])
    tl, link_free = time_layer(p, 0.0, 1, PROFILE, 300, link_free=0.0)
    assert tl.dense_end == 2.0
    assert tl.reads == [(2, 2.0, 5.0), (3, 5.0, 8.0)]
    assert tl.computes == [(0, 2.0, 3.0), (1, 3.0, 4.0), (2, 5.0, 6.0), (3, 8.0, 9.0)]
    assert tl.end == 9.0 and link_free == 8.0


def test_a_busy_link_delays_reads_and_a_deferred_read_waits_for_its_slot():
    # the link is busy until 4 s; expert 3 reuses expert 2's slot, so its read starts when 2 is computed
    p = plan([], [Load(2, 0), Load(3, 0, after=2)], [0, 0, 1, 1])
    tl, link_free = time_layer(p, 0.0, 1, PROFILE, 100, link_free=4.0)
    assert tl.reads == [(2, 4.0, 5.0), (3, 6.0, 7.0)]
    assert tl.computes == [(2, 5.0, 6.0), (3, 7.0, 8.0)]


def test_profile_missing_a_field_names_it(tmp_path):
    f = tmp_path / "p.json"
    f.write_text('{"name": "x", "fast_tier_bytes": 1, "link": {"latency_s": 0}, "expert_compute": {}, '
                 '"dense_s_per_layer": {}, "head_s": {}}')
    with pytest.raises(ProfileError, match="p.json: missing field link.bandwidth_bytes_per_s"):
        HardwareProfile.load(f)
    with pytest.raises(ProfileError, match="no hardware profile 'nonesuch'"):
        HardwareProfile.load("nonesuch")


def test_profile_round_trip(tmp_path):
    PROFILE.save(tmp_path / "unit.json")
    assert HardwareProfile.load(tmp_path / "unit.json") == PROFILE


def test_calibrate_measures_a_usable_profile(tiny_store, tmp_path):
    from moetier.sim.calibrate import calibrate
    from moetier.store.store import Store

    _, path = tiny_store("qwen2_moe")
    p = calibrate(Store(path))
    assert p.link.bandwidth_bytes_per_s > 0 and p.expert_bytes == Store(path).native_layout.blob_bytes
    for f in (p.expert_compute, p.dense_s_per_layer, p.head_s, p.executor_s_per_layer):
        assert f.per_token >= 0 and f.fixed >= 0
    assert p.expert_compute(1) > 0 and p.dense_s_per_layer(1) > 0
    p.save(tmp_path / "m.json")
    assert HardwareProfile.load(tmp_path / "m.json") == p


def test_calibrate_and_sim_commands(tiny_store, tmp_path, capsys):
    import json

    from moetier import Engine
    from moetier.cli import main
    from moetier.trace.record import TraceRecorder

    _, path = tiny_store("olmoe")
    profile = tmp_path / "p.json"
    assert main(["calibrate", "--model", str(path), "--out", str(profile)]) == 0
    with Engine.from_pretrained(path, expert_memory="100%") as engine, TraceRecorder(engine) as rec:
        engine.generate([[5, 6, 7]], max_new_tokens=6, ignore_eos=True)
        rec.trace(["p"]).save(tmp_path / "t")
    capsys.readouterr()
    assert main(["sim", "--trace", str(tmp_path / "t"), "--profile", str(profile), "--model", str(path),
                 "--expert-memory", "50%", "--timeline", str(tmp_path / "tl.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tpot_s"] > 0 and 0 <= out["hit_rate"] <= 1 and out["slots"] == 8
    assert (tmp_path / "tl.png").stat().st_size > 0
    assert main(["sim", "--trace", str(tmp_path / "t"), "--profile", "nonesuch", "--model", str(path)]) == 1
    assert "no hardware profile 'nonesuch'" in capsys.readouterr().err
