"""The whole decode step in one native call (ResidentStep), where every expert is resident: the logits, the KV cache,
what the policy hears and what the counters count are those of the layers run one by one; elsewhere it does not
apply."""

import shutil

import pytest
import torch

from moetier import Engine
from moetier.engine.stats import GenerationStats
from moetier.model import native
from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.model.resident_step import ResidentStep
from moetier.plan.precision import MixedPrecision
from moetier.plan.route import DECODE, PREFILL
from moetier.store.variants import add_precisions

pytestmark = pytest.mark.skipif(native.load().lib is None, reason="no native kernels on this machine")


def run(engine, whole: bool, steps: int = 6):
    """A 3-token prefill, then `steps` greedy decode steps: (each step's logits, the KV cache, what the policy heard,
    the decode counters)."""
    model, policy = engine.model, engine.executor.residency.policy
    heard = []
    on_route, on_access = policy.on_route, policy.on_access
    policy.on_route = lambda r: heard.append(("route", r.layer, r.step, r.topk_ids.tolist(), r.topk_weights.tolist(),
                                              r.scores.tobytes())) or on_route(r)
    policy.on_access = lambda key, precision, step: heard.append(("access", key, precision, step)) or on_access(
        key, precision, step)
    saved, model.resident_step = model.resident_step, model.resident_step if whole else None
    try:
        kv, stats = KVCache(engine.spec, 2, 16, torch.bfloat16), GenerationStats()
        engine.executor.begin_step(PREFILL, stats.phases)
        out = [model.forward(StepBatch.prefill([[5, 9, 13]], [1]), kv)]
        heard.clear()
        for i in range(steps):
            engine.executor.begin_step(DECODE, stats.phases)
            token = int(out[-1][0].float().argmax())
            out.append(model.forward(StepBatch.decode_step([token], [1], [3 + i], 2), kv))
    finally:
        model.resident_step = saved
        del policy.on_route, policy.on_access
    counters = stats.phases[DECODE]
    return out, kv, heard, (counters.layer_steps, counters.needed, counters.hits, counters.loads)


def strip_steps(heard):
    """The heard calls without their step numbers (the two runs' steps count on from different places)."""
    return [h[:2] + h[3:] if h[0] == "route" else h[:3] for h in heard]


@pytest.mark.parametrize("family,overrides,precision", [
    ("olmoe", {}, "native"),  # one norm over all heads' q and k; weights in bf16
    ("qwen3_moe", {}, "native"),  # a norm per head; renormalised top-k
    ("mixtral", {"sliding_window": 4}, "native"),  # fp32 routing weights; a window the context outgrows
    ("olmoe", {"hidden_size": 128, "intermediate_size": 64}, "int4"),  # the integer token kernel
    ("olmoe", {"hidden_size": 128, "intermediate_size": 64}, "int8"),
    # GGML blocks (a table of addresses and types): q4_k_m, its down_proj Q6_K in layer 1, Q4_K in layer 0
    ("olmoe", {"hidden_size": 256, "intermediate_size": 256}, "q4_k_m"),
])
def test_the_step_in_one_call_is_the_layers_bit_for_bit(tiny_store, tmp_path, monkeypatch, family, overrides,
                                                          precision):
    _, source = tiny_store(family, dtype=torch.bfloat16, **overrides)
    path = tmp_path / "store"
    shutil.copytree(source, path)
    if precision != "native":
        add_precisions(path, precision, progress=False)
    calls = []
    step_call = ResidentStep.__call__
    monkeypatch.setattr(ResidentStep, "__call__", lambda self, kv: calls.append(1) or step_call(self, kv))
    engine = Engine.from_pretrained(path, expert_memory="100%", kernels="native",
                                    precision=MixedPrecision(precision), progress=False)
    with engine:
        assert engine.model.resident_step is not None
        engine.preload()
        whole = run(engine, whole=True)
        assert len(calls) == 6  # (every decode step ran in one call)
        layered = run(engine, whole=False)
        assert len(calls) == 6
    (logits_a, kv_a, heard_a, counted_a), (logits_b, kv_b, heard_b, counted_b) = whole, layered
    assert all(torch.equal(a, b) for a, b in zip(logits_a, logits_b))
    assert all(torch.equal(a, b) for a, b in zip(kv_a.k + kv_a.v, kv_b.k + kv_b.v))
    assert kv_a.k[0][1, :, 8].abs().sum() > 0  # (the last step's keys were written)
    assert strip_steps(heard_a) == strip_steps(heard_b) and len(heard_a) > 0
    spec = engine.spec
    assert counted_a == counted_b and counted_a[0] == 6 * len(spec.moe_layers) and counted_a[3] == 0


def test_the_engine_hears_the_steps_routes_as_it_hears_the_layers(tiny_store):
    """Each route heard once, at its own layer and step, in the layers' order; the arrays are the policy's to keep
    (the step's buffers are written again by the next step)."""
    _, path = tiny_store("olmoe", dtype=torch.bfloat16, num_hidden_layers=3)
    engine = Engine.from_pretrained(path, expert_memory="100%", kernels="native", progress=False)
    with engine:
        engine.preload()
        _, _, heard, _ = run(engine, whole=True, steps=2)
        routes = [h for h in heard if h[0] == "route"]
        assert [(r[1], r[2]) for r in routes] == [(layer, s) for s in (2, 3) for layer in range(3)]
        kept = []
        on_route = engine.executor.residency.policy.on_route
        engine.executor.residency.policy.on_route = lambda r: kept.append(r) or on_route(r)
        engine.generate([[5, 9, 13]], max_new_tokens=3, ignore_eos=True)
        first = [r.topk_ids.copy() for r in kept]
    assert all((r.topk_ids == ids).all() for r, ids in zip(kept, first))  # (not written over by later steps)
    assert len({r.topk_ids.ctypes.data for r in kept}) == len(kept)


@pytest.mark.parametrize("family,budget,applies", [
    ("qwen2_moe", "100%", False),  # a shared expert: the layers run
    ("olmoe", "50%", True),  # built, but the engine hands no tables while experts are missing: the layers run
])
def test_where_the_step_does_not_apply_the_layers_run(tiny_store, monkeypatch, family, budget, applies):
    _, path = tiny_store(family, dtype=torch.bfloat16)
    monkeypatch.setattr(ResidentStep, "__call__", lambda *a: pytest.fail("the one-call step ran"))
    engine = Engine.from_pretrained(path, expert_memory=budget, kernels="native", progress=False)
    with engine:
        assert (engine.model.resident_step is not None) == applies
        out = engine.generate([[5, 9, 13]], max_new_tokens=4, ignore_eos=True)
    assert len(out.token_ids[0]) == 4
