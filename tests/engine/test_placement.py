"""Placement in the real engine, with the CPU standing in for both devices: the experts a plan puts on the host are
computed there (from the host tier, with no slot and no read), the rest as before, and the output is exact mode's."""

import pytest
import torch

from moetier import Engine
from moetier.cache.policies import DEFAULT_POLICY
from moetier.cli import main
from moetier.config import MemoryBudget
from moetier.engine.engine import EngineConfig
from moetier.errors import BudgetError, MoetierError
from moetier.memory import MemoryView
from moetier.model.expert_kernels import OneByOne
from moetier.plan.layer_plan import HOST, IN_PLACE
from moetier.sim.replay import PlanLog
from moetier.store.store import Store


def prompts(vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 12)]


class Counting(OneByOne):
    """A host kernel seen expert by expert (`layer`: one call an expert, as a kernel's `layer` computes them)."""

    def __init__(self, call) -> None:
        self.call = call

    def __call__(self, out, x, w, weights) -> None:
        self.call(out, x, w, weights)


def run(path, placement="none", memory="25%", precision=None):
    config = EngineConfig(expert_memory=MemoryBudget.parse(memory), placement=placement,
                          **({"precision": precision} if precision else {}))
    engine = Engine(Store(path), config)
    log, computed = PlanLog(), []
    engine.executor.layer_step.hooks.append(log)
    ex = engine.executor
    for p, kernel in list(ex.host_kernels.items()):
        def counting(out, x, w, weights, p=p, kernel=kernel):  # which host slot, of which precision, each compute read
            pool = ex.host_pools[p]
            computed.append((p, next(i for i in range(pool.num_slots)
                                     if pool.weights(i)["down_proj"].data_ptr() == w["down_proj"].data_ptr())))
            kernel(out, x, w, weights)

        ex.host_kernels[p] = Counting(counting)
    with engine:
        outs = [engine.generate([p], max_new_tokens=8, ignore_eos=True) for p in prompts()]
    return [o.token_ids[0] for o in outs], [o.stats for o in outs], log.plans, computed, engine


@pytest.mark.parametrize("placement", ["smoe-two-pointer", "prescope", "greedy", "hobbit-coop", "cpu-offload"])
def test_host_runs_execute_where_the_plan_put_them_and_the_output_is_exact(tiny_store, placement):
    _, path = tiny_store("qwen2_moe", num_hidden_layers=4)
    exact, *_ = run(path)
    ids, stats, plans, computed, engine = run(path, placement)
    assert ids == exact  # the same kernel on the same weights: computing in place changes no number
    planned = [(r.precision, engine.executor.host_slot(p.layer, r.expert)) for p in plans for r in p.runs
               if r.place == HOST]
    assert planned and computed == planned  # every host run, and nothing else, computed from its host slot
    for p in plans:
        host = {r.expert for r in p.runs if r.place == HOST}
        assert all(r.source == IN_PLACE and r.slot == -1 for r in p.runs if r.place == HOST)
        assert not host & {ld.expert for ld in p.loads}  # no read for them
    assert sum(s["decode"]["host_runs"] + s["prefill"]["host_runs"] for s in stats) == len(planned)
    if placement == "hobbit-coop":
        assert sum(s["prefill"]["host_runs"] for s in stats) == 0  # the prompt runs on the device alone
    if placement == "cpu-offload":
        assert not any(p.loads for p in plans)  # the baseline never reads an expert


def test_placement_is_refused_where_it_cannot_run(tiny_store, capsys):
    _, path = tiny_store("qwen2_moe", num_hidden_layers=4)
    with pytest.raises(MoetierError, match="unknown placement"):
        EngineConfig(placement="fiddler")
    assert main(["generate", "--model", str(path), "--prompt", "x", "--placement", "prescope"]) == 1
    assert "needs --device cuda" in capsys.readouterr().err
    store = Store(path)
    cache = store.spec.top_k * store.native_layout.blob_bytes
    # room for the dense weights, a layer's top-k and half the experts: the cache fits, the host tier does not
    room = MemoryView(int((store.dense_bytes + cache + store.total_expert_bytes() // 2) / 0.8), "test")
    with pytest.raises(BudgetError, match="every expert is kept in host memory"):
        Engine(store, EngineConfig(expert_memory=MemoryBudget("bytes", cache), placement="greedy"), memory=room)


def test_hobbit_coop_computes_low_precision_misses_from_the_hosts_low_copies(tiny_store, tmp_path):
    """HOBBIT §4–5.5.1 with its loader: a decode miss the loader wants at int4 is computed by the CPU from the host's
    int4 copy, an important one from the bf16 copy; engine and simulator make the same plans."""
    import shutil

    import numpy as np

    from moetier.cache.policies import PolicyContext
    from moetier.plan.precision import MixedPrecision
    from moetier.sim.cost import FreeCost
    from moetier.sim.replay import simulate, trace_policy
    from moetier.store.variants import add_precisions
    from moetier.trace.record import TraceRecorder

    _, path = tiny_store("qwen2_moe", dtype=torch.bfloat16, num_hidden_layers=4)
    shutil.copytree(path, tmp_path / "s")
    add_precisions(tmp_path / "s", "int4", progress=False)
    mixed = MixedPrecision("hobbit", t1=0.3, t2=1.0)  # many low, none skipped
    store = Store(tmp_path / "s")
    engine = Engine(store, EngineConfig(expert_memory=MemoryBudget.parse("25%"), placement="hobbit-coop",
                                        precision=mixed))
    log, computed = PlanLog(), []
    engine.executor.layer_step.hooks.append(log)
    ex = engine.executor
    assert set(ex.host_pools) == {"bf16", "int4"}
    for p, kernel in list(ex.host_kernels.items()):
        def counting(out, x, w, weights, p=p, kernel=kernel):
            computed.append(p)
            kernel(out, x, w, weights)

        ex.host_kernels[p] = Counting(counting)
    with engine, TraceRecorder(engine) as recorder:
        for p in prompts():
            engine.generate([p], max_new_tokens=8, ignore_eos=True)
        trace = recorder.trace(["a", "b"])
    host = [r.precision for plan in log.plans for r in plan.runs if r.place == HOST]
    assert computed == host and {"bf16", "int4"} <= set(host)
    entry_bytes = {p: layout.blob_bytes for p, layout in store.manifest.precisions.items()}
    slots = engine.executor.residency.capacity_bytes // entry_bytes["bf16"]
    ctx = PolicyContext(slots, store.spec.moe_layers, store.spec.num_experts, store.spec.top_k)
    sim = simulate(trace, trace_policy(DEFAULT_POLICY, ctx, trace), slots, FreeCost(entry_bytes, "bf16"), "bf16",
                   mixed=mixed, placement="hobbit-coop", keep_plans=True)

    def outcomes(plans):
        return [(p.layer, sorted((r.expert, r.precision, r.source, r.place) for r in p.runs),
                 np.asarray(p.assign_ids).tolist()) for p in plans]

    assert outcomes(sim.plans) == outcomes(log.plans)
