"""With every expert resident and nothing but on-demand planning, a layer skips its plan (ResidentLayers): the same
output bit for bit, the same counters, the same calls to the policy — and planning returns as soon as that stops
holding."""

import shutil

import pytest
import torch

from moetier import Engine
from moetier.cache.keys import ExpertKey
from moetier.cache.policies import LRUPolicy
from moetier.engine.expert_executor import ExpertExecutor
from moetier.engine.resident_layers import ResidentLayers
from moetier.engine.stats import GenerationStats
from moetier.model import native
from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.plan.precision import MixedPrecision
from moetier.plan.route import DECODE, PREFILL
from moetier.plan.step import LayerHook
from moetier.plan.substitute import Substitution
from moetier.store.reader import ExpertReader
from moetier.store.store import Store
from moetier.store.variants import add_precisions


class RecordingLRU(LRUPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.heard: list[tuple] = []

    def on_route(self, route) -> None:
        self.heard.append(("route", route.layer, route.topk_ids.tolist()))  # (steps differ between the two runs)
        super().on_route(route)

    def on_access(self, key: ExpertKey, precision, step: int) -> None:
        self.heard.append(("access", key, precision))
        super().on_access(key, precision, step)


def make_executor(tiny_store, share: float = 1.0, **kw) -> tuple[ExpertExecutor, ExpertReader]:
    _, path = tiny_store("olmoe")
    store = Store(path)
    spec = store.spec
    reader = ExpertReader(store.path)
    slots = max(spec.top_k, int(share * spec.num_expert_keys))
    return ExpertExecutor(spec, store.manifest, slots * store.native_layout.blob_bytes, RecordingLRU(), reader,
                          **kw), reader


def routing(spec, seed: int, tokens: int):
    """Two tokens' routing: x [2, H], scores, topk ids (sharing an expert) and weights; or the first token's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, spec.hidden_size, generator=g)
    scores = torch.rand(2, spec.num_experts, generator=g)
    ids = torch.tensor([[4, 1], [4, 6]])
    return x[:tokens], scores[:tokens], ids[:tokens], torch.rand(2, 2, generator=g)[:tokens]


@pytest.mark.parametrize("tokens", [2, 1])  # (one token: the kernel's `token`, no grouping)
def test_a_resident_layer_is_what_its_plan_computes_and_counts_bit_for_bit(tiny_store, tokens):
    executor, reader = make_executor(tiny_store)
    try:
        spec = executor.spec
        assert executor.preload() == spec.num_expert_keys
        outs, heard, counted = {}, {}, {}
        for name in ("resident", "planned"):
            executor.policy.heard.clear()
            phases = (type(executor.counts.phases[0])(), type(executor.counts.phases[0])())
            executor.begin_step(1, phases)
            if name == "planned":
                executor.resident_layers = None  # as a step that plans
            else:
                assert executor.resident_layers is not None
            outs[name] = [executor(layer, *routing(spec, layer, tokens)) for layer in spec.moe_layers[:-1]]
            if name == "resident":  # (heard at the step's last MoE layer, all of the step's routes in their order)
                assert executor.policy.heard == [] and phases[1].layer_steps == 0
            last = spec.moe_layers[-1]
            outs[name].append(executor(last, *routing(spec, last, tokens)))
            heard[name] = list(executor.policy.heard)
            counted[name] = phases[1]
        assert all(torch.equal(a, b) for a, b in zip(outs["resident"], outs["planned"]))
        experts = 3 if tokens == 2 else 2  # distinct experts a layer: [4, 1] + [4, 6], or [4, 1]
        assert heard["resident"] == heard["planned"] and len(heard["planned"]) == (1 + experts) * len(spec.moe_layers)
        assert counted["resident"] == counted["planned"]
        assert (counted["resident"].hits, counted["resident"].loads) == (experts * len(spec.moe_layers), 0)
    finally:
        reader.close()


def test_resident_layers_refuse_to_start_while_an_expert_is_missing(tiny_store):
    executor, reader = make_executor(tiny_store, share=0.5)
    try:
        executor.preload()  # (half the experts: the cache is full before every one is in)
        assert len(executor.residency) < executor.spec.num_expert_keys
        with pytest.raises(ValueError, match="every expert must be resident"):
            ResidentLayers(executor)
    finally:
        reader.close()


def test_layers_are_planned_while_an_expert_is_missing_or_a_hook_listens(tiny_store):
    executor, reader = make_executor(tiny_store, share=0.5)
    try:
        executor.preload()
        executor.begin_step(1, executor.counts.phases)
        assert executor.resident_layers is None  # half the experts: every layer plans (and may load)
    finally:
        reader.close()
    executor, reader = make_executor(tiny_store)
    try:
        executor.preload()
        listener = LayerHook()
        executor.layer_step.hooks.append(listener)  # e.g. a trace recorder: it hears plans
        executor.begin_step(1, executor.counts.phases)
        assert executor.resident_layers is None
        executor.layer_step.hooks.remove(listener)
        executor.begin_step(1, executor.counts.phases)
        assert executor.resident_layers is not None
    finally:
        reader.close()
    executor, reader = make_executor(tiny_store, substitution=Substitution(alpha=0.0))
    try:
        executor.preload()
        executor.begin_step(1, executor.counts.phases)
        assert executor.resident_layers is None  # another stage plans (here SMoE's, whose α a run may raise)
    finally:
        reader.close()


def decode_logits(engine, steps: int = 4) -> list[torch.Tensor]:
    """A 3-token prefill and `steps` greedy decode steps at batch 1, every expert resident: each step's logits."""
    kv, stats = KVCache(engine.spec, 1, 16, torch.bfloat16), GenerationStats()
    engine.executor.begin_step(PREFILL, stats.phases)
    out = [engine.model.forward(StepBatch.prefill([[5, 9, 13]], [0]), kv)]
    for i in range(steps):
        engine.executor.begin_step(DECODE, stats.phases)
        assert engine.executor.resident_layers is not None
        token = int(out[-1][0].float().argmax())
        out.append(engine.model.forward(StepBatch.decode_step([token], [0], [3 + i], 1), kv))
    return out


@pytest.mark.skipif(native.load().lib is None, reason="no native kernels on this machine")
@pytest.mark.parametrize("precision", ["native", "int8", "int4"])
def test_a_layers_token_table_computes_what_its_token_call_computes(tiny_store, tmp_path, monkeypatch, precision):
    """The native call from the layer's table of addresses, weights as fp32 (ResidentLayers._token_routed), against
    the kernel's `token` on the slots' tensors with the router's weights: the same logits bit for bit."""
    _, source = tiny_store("olmoe", dtype=torch.bfloat16, hidden_size=128, intermediate_size=64)
    path = tmp_path / "store"
    shutil.copytree(source, path)
    if precision != "native":
        add_precisions(path, precision, progress=False)  # (shapes the integer kernel takes)
    runs, called = {}, []
    for name in ("table", "token"):
        with monkeypatch.context() as m:
            if name == "token":
                m.setattr(ResidentLayers, "_token_routed", ResidentLayers._token)
            else:
                m.setattr(ResidentLayers, "_token", lambda *a: called.append(a) or pytest.fail("not the table"))
            engine = Engine.from_pretrained(path, expert_memory="100%", kernels="native",
                                            precision=MixedPrecision(precision), progress=False)
            with engine:
                engine.preload()
                runs[name] = decode_logits(engine)
                assert engine.executor.resident_layers.tables is not None  # (the kernel takes tables here)
    assert all(torch.equal(a, b) for a, b in zip(runs["table"], runs["token"])) and not called
