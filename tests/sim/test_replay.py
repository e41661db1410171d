"""Engine and simulator, driven by the same routing with the same policy and budget, make the identical sequence
of hits and misses: both carry out the plans of one layer step."""

import numpy as np
import pytest

from moetier import Engine
from moetier.cache.policies import DEFAULT_POLICY, POLICIES, PolicyContext
from moetier.config import MemoryBudget
from moetier.engine.engine import EngineConfig
from moetier.sim.replay import PlanLog, replay, trace_policy
from moetier.store.store import Store
from moetier.trace.record import TraceRecorder

PROMPTS = [[5, 9, 17, 33, 65, 100, 3], [7, 8, 9], [120, 4, 4, 4, 4, 50]]


ONLINE = sorted(set(POLICIES) - {"belady"})


def write_trained_policies(store_path, spec):
    """Hand-made files for the learned policies, where the engine looks for them (beside the store)."""
    import json

    import numpy as np

    from moetier.cache.policies.flashmoe_ml import LayerMLP

    mlp = LayerMLP((np.array([[1.0, -1.0], [0.5, 0.2]]), np.array([[1.0], [-0.5]])),
                   (np.array([0.0, 0.1]), np.zeros(1))).to_json()
    files = {"flashmoe-ml": {"layers": {str(layer): mlp for layer in spec.moe_layers}},
             "static-hot": {"counts": [[layer, e, (7 * e + layer) % 5] for layer in spec.moe_layers
                                       for e in range(spec.num_experts)]},
             "hobbit": {"weights": {"lru": 0.5, "lfu": 0.25, "lhu": 0.0, "fld": 0.25}}}
    (store_path / "policies").mkdir(exist_ok=True)
    for name, payload in files.items():
        (store_path / "policies" / f"{name}.json").write_text(json.dumps(payload))


def record(engine, max_new_tokens: int = 12):
    """The engine's plans and its recorded trace over PROMPTS, `max_new_tokens` each (the engine is closed after)."""
    log = PlanLog()
    engine.executor.layer_step.hooks.append(log)
    with engine, TraceRecorder(engine) as recorder:
        for p in PROMPTS:
            engine.generate([p], max_new_tokens=max_new_tokens, ignore_eos=True)
        trace = recorder.trace(["a", "b", "c"])
    return log.plans, trace


def run_both(tiny_store, family, slots, policy, partition="global"):
    _, path = tiny_store(family)
    store = Store(path)
    write_trained_policies(path, store.spec)
    budget = MemoryBudget("bytes", slots * store.native_layout.blob_bytes)
    engine = Engine(store, EngineConfig(expert_memory=budget, policy=policy, cache_partition=partition))
    plans, trace = record(engine)
    engine_outcomes = [(p.layer, [h.expert for h in p.hits], [ld.expert for ld in p.loads]) for p in plans]
    ctx = PolicyContext(slots, store.spec.moe_layers, store.spec.num_experts, store.spec.top_k)
    result = replay(trace, trace_policy(policy, ctx, trace, path), slots, per_layer=partition == "per-layer",
                    precision=store.manifest.native_precision, keep_plans=True)
    assert result.outcomes() == engine_outcomes
    return store, result


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("family,slots", [("olmoe", 2), ("olmoe", 5), ("qwen2_moe", 3), ("mixtral", 9),
                                         ("switch_transformers", 6)])
def test_engine_and_replay_agree_hit_for_hit(tiny_store, family, slots, policy):
    store, result = run_both(tiny_store, family, slots, policy)
    assert result.hits < result.needed  # the budget made misses...
    assert result.hits > 0 or slots <= store.spec.top_k  # ...and, above one layer's top-k, hits


@pytest.mark.parametrize("policy", ONLINE)
@pytest.mark.parametrize("family,slots,partition", [("olmoe", 5, "global"), ("mixtral", 9, "global"),
                                                    ("qwen2_moe", 6, "per-layer")])
def test_every_policy_agrees_between_engine_and_replay(tiny_store, family, slots, partition, policy):
    _, result = run_both(tiny_store, family, slots, policy, partition)
    assert 0 < result.hits < result.needed


def test_the_engine_refuses_the_offline_optimum(tiny_store):
    from moetier.errors import MoetierError

    _, path = tiny_store("olmoe")
    with pytest.raises(MoetierError, match="offline optimum"):
        Engine(Store(path), EngineConfig(policy="belady"))


def test_bad_partitions_are_clear_errors(tiny_store):
    from moetier.errors import BudgetError, MoetierError

    with pytest.raises(MoetierError, match="unknown cache partition 'by-expert'"):
        EngineConfig(cache_partition="by-expert")
    _, path = tiny_store("olmoe", num_layers=3)  # the smallest budget, top-2 slots, is below one per layer
    store = Store(path)
    smallest = MemoryBudget("bytes", store.spec.top_k * store.native_layout.blob_bytes)
    with pytest.raises(BudgetError, match="per-layer cache needs a slot for each of the 3 MoE layers"):
        Engine(store, EngineConfig(expert_memory=smallest, cache_partition="per-layer"))


@pytest.mark.parametrize("mode, slots", [("hobbit", 4), ("low-tier", 16), ("int4", 3)])
def test_engine_and_replay_agree_in_every_precision_mode(tiny_store, tmp_path, mode, slots):
    """The same loads at the same precisions, the same low-tier runs and the same skips — the replay given the mode
    as the engine resolved it: under HOBBIT the model's fitted thresholds (policies/thresholds.json), which the
    engine reads and a mode built afresh does not."""
    import shutil

    import torch

    from moetier.plan.precision import MixedPrecision
    from moetier.policy_files import THRESHOLDS, policy_file, save_thresholds
    from moetier.store.variants import add_precisions

    _, path = tiny_store("olmoe", dtype=torch.bfloat16, num_hidden_layers=4)
    shutil.copytree(path, tmp_path / "s")
    add_precisions(tmp_path / "s", "int4", progress=False)
    if mode == "hobbit":  # (0.5, 0.7: a second expert low or skipped where the paper's 0.6 / 0.9 load it high or low)
        save_thresholds(policy_file(tmp_path / "s", THRESHOLDS), 0.5, 0.7, "hand-made")
    store = Store(tmp_path / "s")
    given = MixedPrecision(mode, low="int4" if mode == "low-tier" else "")
    budget = MemoryBudget("bytes", slots * store.native_layout.blob_bytes)
    engine = Engine(store, EngineConfig(expert_memory=budget, precision=given))
    mixed = engine.precision
    assert mode != "hobbit" or (mixed.t1, mixed.t2) == (0.5, 0.7)
    plans, trace = record(engine)

    def outcomes(plans):
        return [(p.layer, [(r.expert, r.precision, r.source) for r in p.runs],
                 [(ld.expert, ld.precision) for ld in p.loads], p.assign_ids.tolist()) for p in plans]

    ctx = PolicyContext(slots, store.spec.moe_layers, store.spec.num_experts, store.spec.top_k)
    entry_bytes = {p: layout.blob_bytes for p, layout in store.manifest.precisions.items()}
    result = replay(trace, trace_policy(DEFAULT_POLICY, ctx, trace), slots, precision=store.manifest.native_precision,
                    keep_plans=True, mixed=mixed, entry_bytes=entry_bytes)
    assert outcomes(result.plans) == outcomes(plans)
    loads = [ld.precision for p in plans for ld in p.loads]
    assert loads and (mode != "hobbit" or {"bf16", "int4"} <= set(loads))
    if mode == "hobbit":  # the mode as given, with the paper's thresholds, would plan otherwise
        afresh = replay(trace, trace_policy(DEFAULT_POLICY, ctx, trace), slots, precision=store.manifest.native_precision,
                        keep_plans=True, mixed=given, entry_bytes=entry_bytes)
        assert outcomes(afresh.plans) != outcomes(plans)


@pytest.mark.parametrize("policy", ["lru", "smoe-score"])
def test_engine_and_replay_agree_when_substituting(tiny_store, policy):
    """SMoE's substitution decides from the router's scores and the cache: the same substitutes, hits and loads."""
    from moetier.plan.substitute import Substitution

    _, path = tiny_store("qwen2_moe", num_hidden_layers=4)
    store = Store(path)
    slots = 16  # of 32 experts
    budget = MemoryBudget("bytes", slots * store.native_layout.blob_bytes)
    sub = Substitution(alpha=0.5)
    engine = Engine(store, EngineConfig(expert_memory=budget, policy=policy, substitution=sub))
    plans, trace = record(engine)

    def outcomes(plans):
        return [(p.layer, p.assign_ids.tolist(), [r.expert for r in p.hits], [ld.expert for ld in p.loads])
                for p in plans]

    ctx = PolicyContext(slots, store.spec.moe_layers, store.spec.num_experts, store.spec.top_k)
    result = replay(trace, trace_policy(policy, ctx, trace), slots, precision=store.manifest.native_precision,
                    keep_plans=True, substitution=sub)
    assert outcomes(result.plans) == outcomes(plans)
    assert result.counts.phases[1].substituted > 0  # something was substituted, in decode steps only
    assert result.counts.phases[0].substituted == 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_engine_and_replay_agree_plan_for_plan_at_batch_3(tiny_store, policy):
    """Three prompts in one generate call: one prefill step for all of them, then decode steps of three tokens —
    each step's routing the union of its tokens'. The recording carries the steps; the replay makes the same plans."""
    from moetier.sim.replay import steps

    _, path = tiny_store("olmoe", num_hidden_layers=4)
    store = Store(path)
    slots = 5
    engine = Engine(store, EngineConfig(expert_memory=MemoryBudget("bytes", slots * store.native_layout.blob_bytes),
                                        policy=policy))
    log = PlanLog()
    engine.executor.layer_step.hooks.append(log)
    with engine, TraceRecorder(engine) as recorder:
        engine.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)
        trace = recorder.trace(["a", "b", "c"])
    shape = [(phase, len(rows)) for phase, rows in steps(trace)]
    assert shape == [(0, sum(map(len, PROMPTS)))] + [(1, 3)] * 5  # the engine's steps, batched
    ctx = PolicyContext(slots, store.spec.moe_layers, store.spec.num_experts, store.spec.top_k)
    result = replay(trace, trace_policy(policy, ctx, trace), slots, precision=store.manifest.native_precision,
                    keep_plans=True)
    assert result.outcomes() == [(p.layer, [h.expert for h in p.hits], [ld.expert for ld in p.loads])
                                 for p in log.plans]
    assert [p.assign_ids.tolist() for p in result.plans] == [p.assign_ids.tolist() for p in log.plans]


def test_interleaving_a_batch_1_trace_makes_the_engines_batched_steps(tiny_store):
    """The same prompts recorded one call at a time, then interleaved into batches of three, step like the engine
    does with the three in one call."""
    from moetier.sim.replay import steps
    from moetier.trace.batch import interleave

    _, path = tiny_store("olmoe", num_hidden_layers=4)
    with Engine.from_pretrained(path, expert_memory="50%") as engine, TraceRecorder(engine) as recorder:
        for p in PROMPTS:
            engine.generate([p], max_new_tokens=6, ignore_eos=True)
        single = recorder.trace(["a", "b", "c"])
    import dataclasses

    batched = interleave(dataclasses.replace(single, step=None), 3)  # as if recorded before traces kept steps
    assert [(phase, sorted(set(batched.seq[rows].tolist()))) for phase, rows in steps(batched)] == \
        [(0, [0, 1, 2])] + [(1, [0, 1, 2])] * 5
    assert sorted(map(tuple, np.c_[batched.seq, batched.pos])) == sorted(map(tuple, np.c_[single.seq, single.pos]))


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_engine_and_simulator_agree_under_memory_pressure(tiny_store, policy):
    """The cache shrunk between steps (as --adapt does, the least used leaving first by CoMoE's Eq. 18) and grown
    back: the engine and the simulator, told the same resizes at the same steps, make the same plans."""
    from moetier.plan.offload_priority import OffloadPriority
    from moetier.sim.cost import FreeCost
    from moetier.sim.replay import simulate

    _, path = tiny_store("olmoe", num_hidden_layers=4)
    store = Store(path)
    blob, slots = store.native_layout.blob_bytes, 12
    engine = Engine(store, EngineConfig(expert_memory=MemoryBudget("bytes", slots * blob), policy=policy))
    executor = engine.executor
    order = OffloadPriority(store.spec.moe_layers, store.spec.num_experts, lambda k: executor.residency.entries[k].nbytes,
                            lambda: executor.costs.bandwidth)
    executor.layer_step.hooks.append(order)
    resizes = {9: 4, 20: 9, 30: 3}  # step index -> slots

    def pressure(batch=None, phase=None):
        n = resizes.get(executor.layer_step.step - 1)
        if n is not None:
            engine.set_expert_memory(MemoryBudget("bytes", n * blob), order=order)

    engine.step_hooks.append(pressure)
    plans, trace = record(engine)
    ctx = PolicyContext(slots, store.spec.moe_layers, store.spec.num_experts, store.spec.top_k)
    result = simulate(trace, trace_policy(policy, ctx, trace), slots, FreeCost(None, store.manifest.native_precision),
                      store.manifest.native_precision, keep_plans=True, resizes=resizes)
    assert result.outcomes() == [(p.layer, [h.expert for h in p.hits], [ld.expert for ld in p.loads]) for p in plans]
    policy_order = simulate(trace, trace_policy(policy, ctx, trace), slots, FreeCost(None, "native"),
                            keep_plans=True, resizes=resizes, shrink="policy")
    assert policy_order.outcomes() != result.outcomes()  # (the order decided something)


def test_similar_expert_substitution_from_the_trained_file_agrees_with_the_simulator(tiny_store, tmp_path, capsys):
    """CoMoE §III-D end to end: `moetier train similarity` on a calibration trace writes the model's similarities;
    an engine with --substitute similar runs mispredicted low-priority experts as similar cached ones, and the
    simulator, handed the same file, makes the same plans; without the file the engine is refused by name."""
    from moetier.cli import main
    from moetier.errors import MoetierError
    from moetier.plan.similar_substitute import SimilarSubstitution
    from moetier.policy_files import load_similarity

    _, path = tiny_store("qwen2_moe", num_hidden_layers=4, copy=True)
    store = Store(path)
    slots = 12  # of 32 experts
    budget = MemoryBudget("bytes", slots * store.native_layout.blob_bytes)
    config = EngineConfig(expert_memory=budget, substitution=SimilarSubstitution(min_similarity=0.0))
    with pytest.raises(MoetierError, match="moetier train similarity"):
        Engine(store, config)
    with Engine(store, EngineConfig(expert_memory=MemoryBudget.parse("100%"))) as engine, \
            TraceRecorder(engine, gate_inputs=True) as recorder:
        for p in PROMPTS:
            engine.generate([p], max_new_tokens=4, ignore_eos=True)
        recorder.trace(["a", "b", "c"]).save(tmp_path / "calib")
    assert main(["train", "similarity", "--trace", str(tmp_path / "calib"), "--model", str(path)]) in (0, None)
    assert "wrote" in capsys.readouterr().out
    similarity = load_similarity(store.trained_dir(), store.spec.moe_layers, store.spec.num_experts)
    plans, trace = record(Engine(store, config))

    def outcomes(plans):
        return [(p.layer, p.assign_ids.tolist(), [r.expert for r in p.hits], [ld.expert for ld in p.loads])
                for p in plans]

    ctx = PolicyContext(slots, store.spec.moe_layers, store.spec.num_experts, store.spec.top_k)
    result = replay(trace, trace_policy(DEFAULT_POLICY, ctx, trace), slots, precision=store.manifest.native_precision,
                    keep_plans=True, substitution=SimilarSubstitution(min_similarity=0.0, similarity=similarity))
    assert outcomes(result.plans) == outcomes(plans)
    assert result.counts.phases[1].substituted > 0 and result.counts.phases[0].substituted == 0


@pytest.mark.parametrize("policy", ["comoe", "lru+predicted"])
def test_engine_and_replay_agree_with_a_predictor_over_an_encoder(tiny_store, policy):
    """An encoder-decoder (Switch) with a predictor across the encoder's and the decoder's MoE layers: the engine
    handed the oracle of a recorded trace, and the simulator replaying that trace with the same oracle over both
    stacks, make the same plans; stacked-gates replays over both stacks from the trace's gate inputs (the encoder's
    from its own table)."""
    from moetier.sim.predictors import trace_predictor

    _, path = tiny_store("switch_transformers")
    store = Store(path)
    slots = 12  # of 32 experts
    budget = MemoryBudget("bytes", slots * store.native_layout.blob_bytes)
    with Engine(store, EngineConfig(expert_memory=budget)) as engine, \
            TraceRecorder(engine, gate_inputs=True) as recorder:
        for p in PROMPTS:
            engine.generate([p], max_new_tokens=8, ignore_eos=True)
        trace = recorder.trace(["a", "b", "c"])
        routers = {layer: engine.model.w[f"layers.{layer}.router"] for layer in store.spec.moe_layers}
    assert trace.encoder is not None and trace.encoder.gate_inputs is not None
    oracle = trace_predictor("oracle", trace)
    assert set(oracle.moe_layers) == set(store.spec.moe_layers)  # the encoder's layers too
    config = EngineConfig(expert_memory=budget, policy=policy, predictor="oracle")
    plans, again = record(Engine(store, config, predictor=oracle), max_new_tokens=8)
    ctx = PolicyContext(slots, store.spec.moe_layers, store.spec.num_experts, store.spec.top_k)
    result = replay(again, trace_policy(policy, ctx, again), slots, precision=store.manifest.native_precision,
                    keep_plans=True, predictor=trace_predictor("oracle", again))
    assert result.outcomes() == [(p.layer, [h.expert for h in p.hits], [ld.expert for ld in p.loads]) for p in plans]
    gates = replay(trace, trace_policy(policy, ctx, trace), slots, precision=store.manifest.native_precision,
                   predictor=trace_predictor("stacked-gates", trace, routers=routers))
    assert gates.needed == result.needed and gates.hits > 0
