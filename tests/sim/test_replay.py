"""Engine and replay, driven by the same routing with the same policy and budget, make the identical sequence
of hits and misses."""

import pytest

from moetier import Engine
from moetier.cache.policies import make_policy
from moetier.config import MemoryBudget
from moetier.engine.engine import EngineConfig
from moetier.plan.planner import Planner
from moetier.sim.replay import replay
from moetier.store.store import Store
from moetier.trace.record import TraceRecorder

PROMPTS = [[5, 9, 17, 33, 65, 100, 3], [7, 8, 9], [120, 4, 4, 4, 4, 50]]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("family,slots", [("olmoe", 2), ("olmoe", 5), ("qwen2_moe", 3), ("mixtral", 9)])
def test_engine_and_replay_agree_hit_for_hit(tiny_store, family, slots, policy):
    _, path = tiny_store(family)
    store = Store(path)
    budget = MemoryBudget("bytes", slots * store.native_layout.blob_bytes)
    engine = Engine(store, EngineConfig(expert_memory=budget, policy=policy))
    seen = []
    executor = engine.executor
    executor.planner = Planner(executor.planner.num_experts,
                               [*executor.planner.stages, lambda plan: seen.append(plan) or plan])
    with engine, TraceRecorder(engine) as recorder:
        for p in PROMPTS:
            engine.generate([p], max_new_tokens=12, ignore_eos=True)
        trace = recorder.trace(["a", "b", "c"])
    engine_outcomes = [(p.layer, [h.expert for h in p.hits], [ld.expert for ld in p.loads]) for p in seen]
    result = replay(trace, make_policy(policy), slots)
    assert result.outcomes() == engine_outcomes
    assert result.hits < result.needed  # the budget made misses...
    assert result.hits > 0 or slots <= store.spec.top_k  # ...and, above one layer's top-k, hits
