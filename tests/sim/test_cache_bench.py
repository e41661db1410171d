"""`moetier cache-bench` and `moetier train cache-policy` on small hand-made traces."""

import dataclasses
import json

import numpy as np
import pytest

from moetier.cli import main
from moetier.sim.cache_bench import budget_slots, evaluate
from moetier.trace.synthetic import LocalityFit, generate


@pytest.fixture(scope="module")
def trace():
    return generate(LocalityFit(zipf_s=1.0, p_keep=0.5, reuse_next=0.0, source="hand-made"), 4, 16, 2, 150,
                    seed=2, model="hand-made")


def test_every_policy_is_scored_on_the_held_out_part_against_belady(trace):
    records = evaluate(trace, "t", ["25%"], ["lru", "lfu", "belady", "flashmoe-ml", "hobbit", "static-hot"])
    by = {r.policy: r for r in records}
    assert set(by) == {"lru", "lfu", "belady", "flashmoe-ml", "hobbit", "static-hot"}
    assert all(r.hit_rate <= by["belady"].hit_rate for r in records)
    assert by["lru"].gap_closed == 0 and by["belady"].gap_closed == 1
    from moetier.cache.policies import LRUPolicy
    from moetier.sim.replay import replay

    held_out = replay(trace.split(0.7)[1], LRUPolicy(), 16)  # scored on the rest only, from a cold cache
    assert by["lru"].misses == held_out.needed - held_out.hits
    assert all(r.slots == 16 for r in records)  # 25% of 4 layers x 16 experts


def test_budgets_are_shares_or_slot_counts(trace):
    assert budget_slots("50%", trace) == 32 and budget_slots("7", trace) == 7
    from moetier.errors import MoetierError

    with pytest.raises(MoetierError, match="expert memory 1 holds 1 expert.s.; one layer's top-2 needs 2"):
        budget_slots("1", trace)
    with pytest.raises(MoetierError, match="cannot read the budget"):
        budget_slots("lots", trace)


def test_cache_bench_cli_writes_records_and_plot(trace, tmp_path, capsys):
    trace.save(tmp_path / "t")
    out = tmp_path / "r.json"
    assert main(["cache-bench", "--trace", str(tmp_path / "t"), "--expert-memory", "10%,25%", "--policy",
                 "lru,arc,lecar", "--cache-partition", "both", "--json", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    records = json.loads(out.read_text())
    assert {(r["policy"], r["expert_memory"], r["partition"]) for r in records} == {
        (p, b, part) for p in ("lru", "arc", "lecar", "belady") for b in ("10%", "25%")
        for part in ("global", "per-layer")}
    assert all({"trace", "policy", "expert_memory", "hit_rate"} <= r.keys() for r in records)
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "no full router scores" in capsys.readouterr().out
    assert main(["cache-bench", "--trace", str(tmp_path / "t"), "--policy", "mru"]) == 1


def test_train_cache_policy_saves_files_the_policies_read(trace, tmp_path):
    from moetier.cache.policies.context import PolicyContext
    from moetier.policy_files import make_policy_for_model

    trace.save(tmp_path / "t")
    model_dir = tmp_path / "model"
    for policy in ("flashmoe-ml", "hobbit", "static-hot"):
        assert main(["train", "cache-policy", "--policy", policy, "--trace", str(tmp_path / "t"), "--out",
                     str(model_dir / "policies" / f"{policy}.json")]) == 0
    ctx = PolicyContext(16, tuple(trace.layers), 16, 2)
    assert sorted(make_policy_for_model("flashmoe-ml", ctx, model_dir).model.layers) == [0, 1, 2, 3]
    assert sum(dataclasses.astuple(make_policy_for_model("hobbit", ctx, model_dir).weights)) == 1
    assert len(make_policy_for_model("static-hot", ctx, model_dir).hot) == 14


def test_a_trace_without_scores_gives_smoe_its_topk_weights():
    from moetier.sim.replay import topk_scores

    s = topk_scores(np.array([[2, 0]]), np.array([[0.7, 0.3]], np.float32), 4)
    assert s.tolist() == [[pytest.approx(0.3), 0.0, pytest.approx(0.7), 0.0]]


def test_miss_penalty_prices_misses_with_a_profile(tmp_path, capsys):
    from moetier.cache.keys import ExpertKey
    from moetier.cli.models import model_shape
    from moetier.sim.cost import CostModel
    from moetier.sim.profile import HardwareProfile

    demo = generate(LocalityFit(zipf_s=1.0, p_keep=0.5, reuse_next=0.0, source="hand-made"), 4, 8, 2, 200,
                    seed=3, model="demo-coarse")
    demo.save(tmp_path / "d")
    out = tmp_path / "r.json"
    assert main(["cache-bench", "--trace", str(tmp_path / "d"), "--expert-memory", "25%", "--policy", "lru",
                 "--profile", "rtx4090", "--json", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    shape, blob = model_shape("demo-coarse")
    read_s = CostModel.of(HardwareProfile.load("rtx4090"), shape, expert_bytes=blob).read_s(ExpertKey(0, 0))
    for r in json.loads(out.read_text()):
        assert r["miss_penalty_s"] == pytest.approx(r["misses"] * read_s)
        assert r["bytes_per_token"] > 0


def test_a_budget_too_small_for_a_trace_is_skipped_with_a_note(trace):
    notes = []
    records = evaluate(trace, "t", ["1", "25%"], ["lru", "belady"], note=notes.append)
    assert {r.expert_memory for r in records} == {"25%"}
    assert "skipping budget 1" in notes[0] and "one layer's top-2 needs 2" in notes[0]


def test_training_a_policy_for_a_model_with_another_models_trace_is_refused(trace, tmp_path, capsys):
    trace.save(tmp_path / "t")  # 16 experts, top-2
    assert main(["train", "cache-policy", "--policy", "static-hot", "--trace", str(tmp_path / "t"), "--model",
                 "demo-coarse"]) == 1
    assert "is not of demo-coarse (top-2 of 8" in capsys.readouterr().err


def test_with_a_predictor_every_policy_also_runs_as_name_predicted(trace, tmp_path):
    """`--predictor oracle` (the true routing of the coming layers): `lru+predicted` never evicts what the next
    layers need, so it hits at least as often as LRU; every policy hears the predictions."""
    trace.save(tmp_path / "t")
    out = tmp_path / "r.json"
    assert main(["cache-bench", "--trace", str(tmp_path / "t"), "--expert-memory", "25%", "--predictor", "oracle",
                 "--policy", "lru,lru+predicted,comoe,comoe+predicted", "--json", str(out)]) == 0
    by = {r["policy"]: r for r in json.loads(out.read_text())}
    assert set(by) == {"lru", "lru+predicted", "comoe", "comoe+predicted", "belady"}
    assert by["lru"]["hit_rate"] < by["lru+predicted"]["hit_rate"] <= by["belady"]["hit_rate"]
    assert all(r["hit_rate"] <= by["belady"]["hit_rate"] for r in by.values())


def test_hobbit_weights_are_fitted_by_the_mixed_miss_penalty(trace, tmp_path):
    """HOBBIT Fig. 18a's measure: at one precision the penalty is the miss count; in its mixed cache a missed int4
    copy costs a quarter of a missed high one, so penalties fall in quarters and the fit takes the least."""
    import json

    from moetier.cache.policies.context import PolicyContext
    from moetier.cache.policies.hobbit import HobbitPolicy
    from moetier.plan.precision import MixedPrecision
    from moetier.sim.fit import fit_hobbit
    from moetier.sim.replay import replay

    weights = np.random.default_rng(0).dirichlet([1, 1], size=trace.topk_ids.shape[:2])  # [N, L, 2]: HOBBIT's
    trace = dataclasses.replace(trace, topk_weights=-np.sort(-weights, axis=-1).astype(np.float16))  # loader's input
    slots = 6
    _, table = fit_hobbit(trace, slots, step=0.5)
    ctx = PolicyContext(slots, tuple(trace.layers), trace.num_experts, trace.top_k)
    for w, penalty in table:
        result = replay(trace, HobbitPolicy(ctx, w), slots)
        assert penalty == result.needed - result.hits
    weights, mixed = fit_hobbit(trace, slots, step=0.5, mixed=MixedPrecision("hobbit"))
    penalties = [p for _, p in mixed]
    assert any(p != int(p) for p in penalties) and all((4 * p) == int(4 * p) for p in penalties)
    assert dict(mixed)[weights] == min(penalties)
    trace.save(tmp_path / "t")
    assert main(["train", "cache-policy", "--policy", "hobbit", "--precision", "hobbit", "--trace", str(tmp_path / "t"),
                 "--out", str(tmp_path / "h.json")]) == 0
    saved = json.loads((tmp_path / "h.json").read_text())
    assert saved["precision"] == "hobbit" and len(saved["grid"][0]) == 5


def test_hobbit_weights_are_fitted_on_the_runs_own_pair_and_geometry(trace):
    """int8 + int2 (HOBBIT's Jetson pair): a missed int2 copy costs 1/4 of a missed int8 one — not the 1/8 of a
    16-bit one — and the replayed sub-caches hold as many entries as the run's blob sizes make (each grid point's
    penalty is a replay of that very cache)."""
    from moetier.cache.policies import LRUPolicy
    from moetier.cache.policies.context import PolicyContext
    from moetier.cache.policies.hobbit import HobbitPolicy
    from moetier.plan.precision import MixedPrecision, setup
    from moetier.sim.fit import fit_hobbit, miss_penalty
    from moetier.sim.replay import replay

    weights = np.random.default_rng(1).dirichlet([1, 1], size=trace.topk_ids.shape[:2])
    trace = dataclasses.replace(trace, topk_weights=-np.sort(-weights, axis=-1).astype(np.float16))
    slots, mixed = 6, MixedPrecision("hobbit", low="int2", t1=0.6, t2=0.9)
    geometry = {"int8": 12288, "int2": 4096}  # (an int2 blob is a third of an int8 one after alignment: not a quarter)
    best, table = fit_hobbit(trace, slots, step=0.5, mixed=mixed, high="int8", entry_bytes=geometry)
    penalties = [p for _, p in table]
    assert all(4 * p == int(4 * p) for p in penalties) and any(p != int(p) for p in penalties)
    made = setup(mixed, "int8", geometry, slots * geometry["int8"], LRUPolicy(), tuple(trace.layers), 16, 2)
    assert made.residency.slots("int2") == slots * 12288 // 4 // 4096 == 4  # 25% of the bytes, in 4 KiB entries
    ctx = PolicyContext(slots, tuple(trace.layers), trace.num_experts, trace.top_k, "int8")
    for w, penalty in table:
        plans = replay(trace, HobbitPolicy(ctx, w), slots, precision="int8", keep_plans=True, mixed=mixed,
                       entry_bytes=geometry).plans
        assert penalty == miss_penalty(plans, "int8")
        assert {ld.precision for p in plans for ld in p.loads} == {"int8", "int2"}
    assert dict(table)[best] == min(penalties)


def test_train_hobbit_for_a_model_fits_its_pair_and_thresholds(tmp_path, capsys):
    """`train cache-policy --policy hobbit --model M` fits for M's runs by default: the mixed penalty, the pair asked
    (int8 + int2), M's own thresholds (policies/thresholds.json) — and says so in the file."""
    from moetier.policy_files import load_thresholds
    from moetier.resolve import builtin_models, resolve_model
    from moetier.store.store import Store

    spec = Store(resolve_model("demo-coarse", None, progress=False)).spec
    t = generate(LocalityFit(zipf_s=1.0, p_keep=0.5, reuse_next=0.0, source="hand-made"), len(spec.moe_layers),
                 spec.num_experts, spec.top_k, 120, seed=3, model="demo-coarse", layers=list(spec.moe_layers))
    t.save(tmp_path / "t")
    out = tmp_path / "hobbit.json"
    assert main(["train", "cache-policy", "--policy", "hobbit", "--trace", str(tmp_path / "t"), "--model", "demo-coarse",
                 "--out", str(out), "--high-precision", "int8", "--low-precision", "int2"]) == 0
    saved = json.loads(out.read_text())
    assert saved["precision"] == "hobbit" and saved["pair"] == ["int8", "int2"]
    assert tuple(saved["thresholds"]) == load_thresholds(builtin_models()["demo-coarse"])
    assert "(int8 + int2, T1 " in capsys.readouterr().out


def test_a_shipped_models_files_are_never_written_and_a_foreign_table_is_one_line(trace, tmp_path, capsys):
    """(`train cache-policy` with the default --model overwrote models/demo-fine/policies/flashmoe-ml.json; with
    --out it skipped the trace's check, and the file then crashed `generate --policy static-hot` with a KeyError.)"""
    import shutil

    from moetier.resolve import builtin_models

    shipped = builtin_models()["demo-coarse"] / "policies" / "static-hot.json"
    before = shipped.read_bytes() if shipped.exists() else None
    trace.save(tmp_path / "t")
    demo = generate(LocalityFit(zipf_s=1.0, p_keep=0.5, reuse_next=0.0, source="hand-made"), 4, 8, 2, 200,
                    seed=3, model="demo-coarse")
    demo.save(tmp_path / "d")
    assert main(["train", "cache-policy", "--policy", "static-hot", "--trace", str(tmp_path / "d")]) == 1
    assert "give --model" in capsys.readouterr().err
    assert main(["train", "cache-policy", "--policy", "static-hot", "--trace", str(tmp_path / "d"), "--model",
                 "demo-coarse"]) == 1
    assert "shipped with moetier, which is never written" in capsys.readouterr().err
    assert (shipped.read_bytes() if shipped.exists() else None) == before
    # a table of another model's trace (16 experts) in a copy of demo-coarse (8): refused in one line
    copy = tmp_path / "my-coarse"
    shutil.copytree(builtin_models()["demo-coarse"], copy)
    assert main(["train", "cache-policy", "--policy", "static-hot", "--trace", str(tmp_path / "t"), "--out",
                 str(copy / "policies" / "static-hot.json")]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(copy), "--policy", "static-hot", "--prompt", "x", "--max-tokens",
                 "2"]) == 1
    last = capsys.readouterr().err.splitlines()[-2:]  # (after the conversion's progress lines)
    assert last[0].startswith("moetier: error: ") and "was trained on another model's trace" in last[0]
    assert last[1].startswith("  hint: ") and "Traceback" not in "".join(last)
    assert main(["train", "cache-policy", "--policy", "static-hot", "--trace", str(tmp_path / "d"), "--model",
                 str(copy)]) == 0  # the copy is the user's: written


def test_both_partitions_are_told_apart_in_the_table_and_the_plot(trace, tmp_path, monkeypatch):
    """`--cache-partition both`: a budget's global and per-layer rows differ in a column of their own, and the
    plot draws a line for each (policy, partition), never one line through both partitions' points."""
    from matplotlib.figure import Figure

    from moetier.sim.cache_bench import format_table, plot

    records = [r for part in ("global", "per-layer") for r in evaluate(trace, "t", ["25%", "50%"], ["lru", "belady"],
                                                                        part)]
    lines = format_table(records).splitlines()
    assert lines[0].split()[:3] == ["trace", "budget", "partition"]
    assert {tuple(line.split()[1:4]) for line in lines[1:]} == {
        (b, part, p) for b in ("25%", "50%") for part in ("global", "per-layer") for p in ("lru", "belady")}
    assert "partition" not in format_table([r for r in records if r.partition == "global"]).splitlines()[0]
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: drawn.append(fig))
    plot(records, tmp_path / "p.png")
    lines = {line.get_label(): line.get_xdata().tolist() for line in drawn[0].axes[0].get_lines()}
    assert lines == {f"{p} ({part})": [16, 32] for p in ("lru", "belady") for part in ("global", "per-layer")}
