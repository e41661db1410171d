"""Placement in the real engine, with the CPU standing in for both devices: the experts a plan puts on the host are
computed there (from the host tier, with no slot and no read), the rest as before, and the output is exact mode's."""

import pytest
import torch

from moetier import Engine
from moetier.cli import main
from moetier.config import MemoryBudget
from moetier.engine.engine import EngineConfig
from moetier.errors import BudgetError, MoetierError
from moetier.memory import MemoryView
from moetier.plan.layer_plan import HOST, IN_PLACE
from moetier.sim.replay import PlanLog
from moetier.store.store import Store


def prompts(vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 12)]


def run(path, placement="none", memory="25%"):
    config = EngineConfig(expert_memory=MemoryBudget.parse(memory), placement=placement)
    engine = Engine(Store(path), config)
    log, computed = PlanLog(), []
    engine.executor.layer_step.hooks.append(log)
    if placement != "none":
        kernel = engine.executor.host_kernel

        def counting(out, x, w, weights):  # which host slot each host compute read
            computed.append(next(i for i in range(engine.executor.host_pool.num_slots)
                                 if engine.executor.host_pool.weights(i)["down_proj"].data_ptr()
                                 == w["down_proj"].data_ptr()))
            kernel(out, x, w, weights)

        engine.executor.host_kernel = counting
    with engine:
        outs = [engine.generate([p], max_new_tokens=8, ignore_eos=True) for p in prompts()]
    return [o.token_ids[0] for o in outs], [o.stats for o in outs], log.plans, computed, engine


@pytest.mark.parametrize("placement", ["smoe-two-pointer", "prescope", "greedy", "hobbit-coop", "cpu-offload"])
def test_host_runs_execute_where_the_plan_put_them_and_the_output_is_exact(tiny_store, placement):
    _, path = tiny_store("qwen2_moe", num_hidden_layers=4)
    exact, *_ = run(path)
    ids, stats, plans, computed, engine = run(path, placement)
    assert ids == exact  # the same kernel on the same weights: computing in place changes no number
    planned = [engine.executor.host_slot(p.layer, r.expert) for p in plans for r in p.runs if r.place == HOST]
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
