"""The real executor computes from the plan alone: a hand-made plan with a substitute, a skipped expert and a
prefetch gives what a direct computation of that assignment gives, and the prefetched expert lands."""

import numpy as np
import torch

from moetier.cache.keys import ExpertKey
from moetier.cache.policies import LRUPolicy
from moetier.engine.expert_executor import ExpertExecutor
from moetier.plan.layer_plan import RESIDENT
from moetier.store.reader import ExpertReader
from moetier.store.store import Store
from tests.handmade_plan import PrefetchAfter, Substitute, direct


def expert_weights(store: Store, layer: int) -> dict[int, tuple]:
    """Each expert of `layer` read straight from its blob: (gate_up_proj, down_proj)."""
    out = {}
    for e in range(store.spec.num_experts):
        t = store.read_expert(layer, e)
        out[e] = (t["gate_up_proj"], t["down_proj"])
    return out


def test_a_hand_made_plan_with_a_substitute_a_skip_and_a_prefetch(tiny_store):
    _, path = tiny_store("olmoe")
    store = Store(path)
    spec, blob_bytes = store.spec, store.native_layout.blob_bytes
    reader = ExpertReader(store.path)
    executor = ExpertExecutor(spec, store.manifest, 5 * blob_bytes, LRUPolicy(), reader)
    try:
        executor.preload([ExpertKey(0, 6)])  # the substitute is resident
        stages = executor.layer_step.planner.stages
        stages.insert(0, Substitute(layer=0, swap={(0, 1): 6}, skip=[(1, 0)]))
        stages.append(PrefetchAfter(executor.residency, layer=0, keys=[ExpertKey(1, 7)], precision="fp32"))
        torch.manual_seed(0)
        x = torch.randn(2, spec.hidden_size)
        topk_ids = torch.tensor([[0, 1], [2, 3]])  # token 0's expert 1 becomes 6; token 1's expert 2 is skipped
        topk_weights = torch.tensor([[0.6, 0.4], [0.7, 0.3]])
        scores = torch.zeros(2, spec.num_experts)
        executor.begin_step(0, executor.counts.phases)
        out = executor(0, x, scores, topk_ids, topk_weights)
        plan_ids = np.array([[0, 6], [-1, 3]])
        expected = direct(x, plan_ids, topk_weights.numpy(), expert_weights(store, 0))
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        phase = executor.counts.phases[0]
        assert (phase.needed, phase.hits, phase.loads) == (3, 1, 2)  # 0, 3 loaded; 6 resident; 1 and 2 not run
        key = ExpertKey(1, 7)
        executor.pool.completions[executor.residency.entries[key].slot].wait()
        executor._poll_landed()
        assert key in executor.residency  # the prefetch landed and is resident
        w = executor.pool.weights(executor.residency.entries[key].slot)
        gate_up, down = expert_weights(store, 1)[7]
        assert torch.equal(w["gate_up_proj"], gate_up) and torch.equal(w["down_proj"], down)
        plan = executor.layer_step.begin(_route(1, [[7, 0]], spec.num_experts, executor.layer_step.step))
        assert plan.runs[0].expert == 7 and plan.runs[0].source == RESIDENT
    finally:
        reader.close()


def _route(layer, ids, num_experts, step):
    from moetier.plan.route import RouteResult

    ids = np.asarray(ids, np.int64)
    return RouteResult(layer, step, ids, np.full(ids.shape, 0.5, np.float32), np.zeros((len(ids), num_experts),
                                                                                     np.float32))
