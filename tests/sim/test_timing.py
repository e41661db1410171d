"""The cost model, hardware profiles and calibration."""

import dataclasses

import pytest

from moetier.sim.cost import CostModel
from moetier.sim.profile import (
    Device,
    HardwareProfile,
    Linear,
    Measured,
    Piecewise,
    ProfileError,
    Tier,
    mean_curve,
    piecewise,
)
from moetier.sim.shapes import ModelShape

SHAPE = ModelShape("unit", hidden_size=8, num_layers=1, moe_layers=(0,), num_experts=4, top_k=2,
                   moe_intermediate_size=16, attention_params=256, kv_per_token=16, vocab_size=32)
CPU = Device("cpu", memory_bandwidth_bytes_per_s=1e9, flops={"bf16": 1e12}, call_overhead_s=1e-6)
PROFILE = HardwareProfile("unit", 10**9, (Tier("disk", bandwidth_bytes_per_s=100.0),), {"cpu": CPU}, "cpu",
                          measured=(Measured(8, 16, "bf16", expert_s=Linear(0.0, 1.0),
                                             dense_s_per_layer=Linear(0.0, 2.0), head_s=Linear(0.0, 0.0)),))


def cost(expert_bytes: int, profile: HardwareProfile = PROFILE) -> CostModel:
    return CostModel.of(profile, SHAPE, "bf16", expert_bytes)


def test_profile_missing_a_field_names_it(tmp_path):
    f = tmp_path / "p.json"
    f.write_text('{"name": "x", "fast_tier_bytes": 1, "tiers": [{"name": "ssd", "latency_s": 0}], "devices": {}, '
                 '"compute_device": "cpu"}')
    with pytest.raises(ProfileError, match=r"p.json: missing field tiers\[0\].bandwidth_bytes_per_s"):
        HardwareProfile.load(f)
    f.write_text('{"name": "x", "fast_tier_bytes": 1, "tiers": [{"name": "ssd", "bandwidth_bytes_per_s": 1}], '
                 '"devices": {"gpu": {"flops": {}}}, "compute_device": "gpu"}')
    with pytest.raises(ProfileError, match="p.json: missing field devices.gpu.memory_bandwidth_bytes_per_s"):
        HardwareProfile.load(f)
    with pytest.raises(ProfileError, match="no hardware profile 'nonesuch'"):
        HardwareProfile.load("nonesuch")
    import json

    d = PROFILE.to_json()
    d["measured"][0]["expert_s"] = {"points": [[2, 0.5], [1, 0.6]]}  # tokens not increasing
    f.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=r"p.json: measured\[0\].expert_s: a piecewise cost needs"):
        HardwareProfile.load(f)


@pytest.mark.parametrize("field, value", [("bandwidth_bytes_per_s", 0.0), ("utilisation", 1.5), ("latency_s", -1.0),
                                          ("cpu_s_per_byte", -1e-9), ("per_read_s", -1e-4)])
def test_a_tier_out_of_range_says_which_ranges_hold(field, value):
    with pytest.raises(ProfileError, match="tier 'ssd': bandwidth must be positive, utilisation in"):
        Tier(**{"name": "ssd", "bandwidth_bytes_per_s": 1.0, field: value})


def test_profile_round_trip(tmp_path):
    PROFILE.save(tmp_path / "unit.json")
    assert HardwareProfile.load(tmp_path / "unit.json") == PROFILE
    import dataclasses

    curved = dataclasses.replace(PROFILE, measured=(dataclasses.replace(
        PROFILE.measured[0], expert_s=Piecewise(((1.0, 0.5), (4.0, 0.5), (8.0, 1.0)))),))
    curved.save(tmp_path / "curved.json")
    assert HardwareProfile.load(tmp_path / "curved.json") == curved


def test_a_piecewise_cost_is_straight_between_its_points_and_carries_the_last_slope_beyond():
    # flat while streaming the weights (1..4 tokens), then 0.125 s a token: what one line through all would miss
    c = Piecewise(((1.0, 0.5), (4.0, 0.5), (8.0, 1.0)))
    assert [c(t) for t in (0.5, 1, 2, 4, 6, 8, 16)] == pytest.approx([0.5, 0.5, 0.5, 0.5, 0.75, 1.0, 2.0])
    # a later point measured faster is noise: made flat, never a cost that falls with more tokens
    assert piecewise([4, 1, 2], [0.9, 1.0, 0.8]).points == ((1.0, 1.0), (2.0, 1.0), (4.0, 1.0))
    assert [v for pt in mean_curve(c, Linear(0.1, 0.0)).points for v in pt] == pytest.approx([1, 0.3, 4, 0.45, 8, 0.9])
    assert mean_curve(Linear(0.2, 1.0), Linear(0.4, 3.0)) == Linear(pytest.approx(0.3), pytest.approx(2.0))
    for bad in (((1.0, 0.5),), ((2.0, 0.5), (1.0, 0.6)), ((0.0, 0.5), (1.0, 0.6)), ((1.0, -0.1), (2.0, 0.6))):
        with pytest.raises(ProfileError, match="piecewise cost needs two or more"):
            Piecewise(bad)


def test_calibrating_another_shape_keeps_the_first():
    import dataclasses

    other = Measured(16, 32, "bf16", Linear(0.0, 5.0), Linear(0.0, 6.0), Linear(0.0, 7.0))
    newer = dataclasses.replace(PROFILE, measured=(other,))
    assert newer.merged_with(PROFILE).measured == (other, PROFILE.measured[0])
    remeasured = dataclasses.replace(PROFILE.measured[0], expert_s=Linear(0.0, 9.0))
    assert dataclasses.replace(PROFILE, measured=(remeasured,)).merged_with(PROFILE).measured == (remeasured,)


def test_roofline_is_flat_while_memory_bound_then_linear():
    # no measured figures for this shape: the device's roofline. Expert: 3*8*16 = 384 params, 768 bytes in bf16
    # at 1 GB/s = 768 ns; 768 FLOPs per token at 1 TFLOP/s = 0.768 ns: memory-bound up to 1000 tokens
    bare = HardwareProfile("unit", 10**9, PROFILE.tiers, {"cpu": CPU}, "cpu")
    c = CostModel.of(bare, SHAPE, "bf16", 768)
    assert c.expert_s(1) == pytest.approx(1e-6 + 768e-9)
    assert c.expert_s(500) == c.expert_s(1)
    assert c.expert_s(4000) == pytest.approx(1e-6 + 4000 * 768e-12)


def test_experts_beyond_a_tiers_capacity_are_read_through_it_from_below():
    # host DRAM over a 100 B/s link holds two experts; the rest come from an SSD at 10 B/s behind it
    tiers = (Tier("dram", 100.0, latency_s=1.0, bytes=200), Tier("ssd", 10.0, latency_s=2.0))
    c = cost(100, HardwareProfile("unit", 10**9, tiers, {"cpu": CPU}, "cpu", measured=PROFILE.measured))
    from moetier.cache.keys import ExpertKey

    assert [c.tier_index(ExpertKey(0, e)) for e in range(4)] == [0, 0, 1, 1]
    assert c.read_s(ExpertKey(0, 0)) == pytest.approx(1.0 + 1.0)
    assert c.read_s(ExpertKey(0, 3)) == pytest.approx(3.0 + 10.0)


def test_anchoring_prices_experts_as_the_step_computed_them_and_puts_the_rest_on_the_executor():
    import dataclasses

    from moetier.calibrate import DecodeStep, anchored

    int4 = dataclasses.replace(PROFILE.measured[0], precision="int4", expert_s=Piecewise(((1.0, 2.0), (2.0, 3.0))))
    profile = dataclasses.replace(PROFILE, measured=(PROFILE.measured[0], int4))
    # one MoE layer, top-2, dense 2 s, head 0. The step: 7 s, its experts 1.5 s each (timed alone: 1 s); int4's
    # 1 s each in its own step (timed alone: 2 s)
    got = anchored(profile, SHAPE, 768, {"bf16": DecodeStep(7.0, 1.5), "int4": DecodeStep(9.0, 1.0)})
    bf16, low = got.measured
    assert bf16.expert_s(1) == pytest.approx(1.5) and low.expert_s(1) == pytest.approx(1.0)
    assert low.expert_s(2) == pytest.approx(1.5)  # the curve scaled whole: its growth with tokens kept
    assert got.executor_s_per_layer == Linear(0.0, pytest.approx(7.0 - 2.0 - 2 * 1.5))  # the rest of the step
    assert cost(768, got).resident_layer_s(0, 1) + cost(768, got).head_s(1) == pytest.approx(7.0)
    # a precision with no step of its own takes the model's own ratio (here 1.5: int4 2 s -> 3 s)
    alone = anchored(profile, SHAPE, 768, {"bf16": DecodeStep(7.0, 1.5)})
    assert alone.measured[1].expert_s(1) == pytest.approx(3.0)
    for bad in ((0.0, 1.0), (1.0, 0.0), (1.0, 1.0, -0.1)):  # a step that took no time, or a negative scoring
        with pytest.raises(ValueError, match="a decode step needs positive times"):
            DecodeStep(*bad)
    # a step faster than its parts leaves the executor nothing (never a negative cost)
    assert anchored(profile, SHAPE, 768, {"bf16": DecodeStep(4.0, 1.5)}).executor_s_per_layer == Linear(0.0, 0.0)
    # an executor measured growing 0.5 s a token keeps that growth; the step sets its cost at one token
    growing = dataclasses.replace(profile, executor_s_per_layer=Linear(0.5, 0.0))
    assert anchored(growing, SHAPE, 768, {"bf16": DecodeStep(7.0, 1.5)}).executor_s_per_layer == Linear(
        0.5, pytest.approx(1.5))  # 2 s at one token: 7 - 2 (dense) - 3 (experts)
    assert anchored(growing, SHAPE, 768, {"bf16": DecodeStep(4.0, 1.5)}).executor_s_per_layer == Linear(0.0, 0.0)


def test_calibrate_measures_a_usable_profile(tiny_store, tmp_path):
    from moetier.calibrate import calibrate
    from moetier.store.store import Store

    _, path = tiny_store("qwen2_moe")
    p = calibrate(Store(path), progress=False)
    disk = p.tiers[0]
    assert disk.bandwidth_bytes_per_s > 0 and disk.latency_s >= 0 and disk.cpu_s_per_byte > 0  # reading takes CPU
    m = p.measured[0]
    assert (m.hidden_size, m.moe_intermediate_size) == (Store(path).spec.hidden_size,
                                                        Store(path).spec.moe_intermediate_size)
    for f in (m.dense_s_per_layer, m.head_s, p.executor_s_per_layer):
        assert f.per_token >= 0 and f.fixed >= 0
    times = [s for _, s in m.expert_s.points]  # measured at each token count, never falling
    assert len(times) >= 4 and times == sorted(times) and times[0] > 0
    assert m.expert_s(1) > 0 and m.dense_s_per_layer(1) > 0
    assert p.predict_s_per_layer(1) > 0  # the stacked-gates predictor, timed inside the engine's step
    assert p.device.memory_bandwidth_bytes_per_s > 1e8 and all(v > 1e8 for v in p.device.flops.values())
    assert {"int8", "int4", "int2"} <= set(p.device.flops)  # each quantized kernel's, for shapes not measured
    p.save(tmp_path / "m.json")
    assert HardwareProfile.load(tmp_path / "m.json") == p


def test_a_calibrated_profile_prices_a_shape_it_never_measured_in_every_doctor_mode(tiny_store):
    """`moetier doctor BIG` on a fresh machine: calibrated on a small model with no quantized copies, the profile
    still prices another shape's int4 copies (HOBBIT, the low tier) from the CPU's int4 kernel."""
    import torch

    from moetier.calibrate import calibrate
    from moetier.cli.models import model_shape
    from moetier.sim.doctor import diagnose
    from moetier.store.store import Store

    _, path = tiny_store("qwen2_moe", torch.bfloat16)
    assert list(Store(path).manifest.precisions) == ["bf16"]
    shape, _ = model_shape("olmoe-1b-7b")
    plan = diagnose(shape, calibrate(Store(path), progress=False), tokens=8)
    priced = {c["mode"] for c in plan["cells"] if c["tpot_s"] is not None}
    assert {"exact", "hobbit", "low-tier", "substitution"} <= priced


def test_calibrate_measures_each_quantized_copy_from_its_blobs(tiny_store, tmp_path):
    """A store with int4 copies gets a measured expert cost at int4 too (its kernel unpacks codes: the roofline
    would flatter it), and the cost model prices an int4 expert by it."""
    import shutil

    import torch

    from moetier.calibrate import calibrate
    from moetier.sim.cost import CostModel
    from moetier.sim.shapes import ModelShape
    from moetier.store.store import Store
    from moetier.store.variants import add_precisions

    _, path = tiny_store("olmoe", dtype=torch.bfloat16)
    shutil.copytree(path, tmp_path / "s")
    add_precisions(tmp_path / "s", "int4", progress=False)
    store = Store(tmp_path / "s")
    p = calibrate(store, progress=False)
    assert [m.precision for m in p.measured] == ["bf16", "int4"]
    int4 = p.measured[1]
    assert int4.expert_s(1) > 0 and int4.dense_s_per_layer == p.measured[0].dense_s_per_layer
    cost = CostModel.of(p, ModelShape.from_spec(store.spec, "s", "bf16"), "bf16").at("int4")
    assert cost.expert_s(1) == pytest.approx(int4.expert_s(1))


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
    assert main(["sim", "--trace", str(tmp_path / "t"), "--profile", str(profile), "--model-shape", str(path),
                 "--expert-memory", "50%", "--timeline", str(tmp_path / "tl.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tpot_s"] > 0 and 0 <= out["hit_rate"] <= 1 and out["slots"] == 8
    assert (tmp_path / "tl.png").stat().st_size > 0
    assert main(["sim", "--trace", str(tmp_path / "t"), "--profile", "nonesuch", "--model-shape", str(path)]) == 1
    assert "no hardware profile 'nonesuch'" in capsys.readouterr().err


def test_the_disk_is_timed_on_the_models_own_blobs_where_the_store_holds_quantized_copies(tiny_store, tmp_path,
                                                                                           monkeypatch):
    """A lone read's latency is its time less its blob's share of the bandwidth: timed on int4 blobs a quarter
    the size (half of a store with int4 copies) and charged a bf16 blob's transfer, it read as latency what was
    not (demo-deep-xl: ~1.9 ms where a lone bf16 read takes its bytes over the bandwidth)."""
    import shutil

    import torch

    from moetier.calibrate import disk_tier
    from moetier.store.reader import ExpertReader
    from moetier.store.store import Store
    from moetier.store.variants import add_precisions

    _, path = tiny_store("olmoe", dtype=torch.bfloat16)
    shutil.copytree(path, tmp_path / "s")
    add_precisions(tmp_path / "s", "int4", progress=False)
    read = []
    submit = ExpertReader.submit
    monkeypatch.setattr(ExpertReader, "submit", lambda self, blob, *a, **k: (read.append(blob),
                                                                             submit(self, blob, *a, **k))[1])
    store = Store(tmp_path / "s")
    assert {b.precision for b in store.manifest.blobs} == {"bf16", "int4"}
    tier = disk_tier(store, reads=4)
    assert {b.precision for b in read} == {"bf16"} and len([b for b in read if b.expert >= 0]) == 8  # (and spans)
    assert tier.bandwidth_bytes_per_s > 0 and tier.latency_s >= 0


def test_small_blobs_are_timed_beside_larger_spans_of_their_file_so_the_disk_carries_over_to_larger_experts(
        tiny_store, tmp_path):
    """A request costs a small read most of its time (demo-fine's 192 KiB experts queued at ~0.65 GB/s, 12 MiB ones
    at 3.7): larger spans of the same file split a read into a cost per request and bytes over a bandwidth."""
    import dataclasses

    import torch

    from moetier.calibrate import SPANS, disk_tier, larger_spans
    from moetier.store.format import ALIGN
    from moetier.store.store import Store

    _, path = tiny_store("olmoe", dtype=torch.bfloat16, num_experts=64)  # (a file 8 x 4 blobs long, at least)
    store = Store(path)
    blob = store.manifest.blobs[0]
    size = store.manifest.sources[blob.segments[0].source].size if blob.linked else \
        (store.path / blob.file).stat().st_size
    spans = larger_spans(store, blob, SPANS)
    assert len(spans) == SPANS and all(s.length >= 4 * blob.length and s.length % ALIGN == 0 for s in spans)
    extents = [(s.segments[0].offset if s.linked else s.offset, s.length) for s in spans]
    assert all(offset % ALIGN == 0 and offset + length <= size for offset, length in extents)
    assert len({offset for offset, _ in extents}) == SPANS  # side by side, none read twice
    assert larger_spans(store, dataclasses.replace(blob, length=size // 4), SPANS) == []  # blobs that large already: none
    tier = disk_tier(store, reads=4)
    assert tier.per_read_s >= 0 and tier.bandwidth_bytes_per_s > 0


def test_a_read_holds_the_link_for_its_request_and_its_bytes(tmp_path):
    from moetier.cache.keys import ExpertKey

    cpu = Device("cpu", 1e10, {"bf16": 1e12})
    for per_read in (0.0, 2e-3):
        disk = Tier("disk", 1e9, latency_s=1e-3, per_read_s=per_read)
        profile = HardwareProfile("p", 1 << 30, (disk,), {"cpu": cpu}, "cpu")
        cost = CostModel.of(profile, SHAPE, "bf16", 10**6)
        assert cost.read_busy_s(ExpertKey(SHAPE.moe_layers[0], 0)) == pytest.approx(1e-3 + per_read)
        assert cost.read_s(ExpertKey(SHAPE.moe_layers[0], 0)) == pytest.approx(2e-3 + per_read)
    profile.save(tmp_path / "p.json")
    assert HardwareProfile.load(tmp_path / "p.json").tiers[0].per_read_s == 2e-3


def test_the_doctor_notes_a_disk_timed_on_far_smaller_reads_alone():
    """A profile whose disk was timed on tiny experts at one size prices a 12 MiB expert's read several times slow:
    the plan says so; not where calibration split off the request's cost, nor for a model of the same size."""
    from moetier.sim.doctor import small_reads_note

    tiny = Measured(64, 512, "bf16", Linear(0.0, 1e-5), Linear(0.0, 1e-5), Linear(0.0, 1e-5))  # 192 KiB
    one_size = HardwareProfile("this-machine", 1 << 30, (Tier("disk", 6.5e8),), {"cpu": CPU}, "cpu", measured=(tiny,))
    note = small_reads_note(one_size, 12 << 20)
    assert note is not None and "192.0 KiB" in note and "moetier calibrate --model" in note
    assert small_reads_note(one_size, 1 << 20) is None  # ~5x: close enough
    split = dataclasses.replace(one_size, tiers=(Tier("disk", 3.7e9, per_read_s=2.5e-4),))
    assert small_reads_note(split, 12 << 20) is None
    assert small_reads_note(dataclasses.replace(one_size, measured=()), 12 << 20) is None  # a paper's machine
