"""With every expert resident and nothing but on-demand planning, a layer skips its plan (ResidentLayers): the same
output bit for bit, the same counters, the same calls to the policy — and planning returns as soon as that stops
holding."""

import pytest
import torch

from moetier.cache.keys import ExpertKey
from moetier.cache.policies import LRUPolicy
from moetier.engine.expert_executor import ExpertExecutor
from moetier.plan.step import LayerHook
from moetier.plan.substitute import Substitution
from moetier.store.reader import ExpertReader
from moetier.store.store import Store


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
            outs[name] = [executor(layer, *routing(spec, layer, tokens)) for layer in spec.moe_layers]
            heard[name] = list(executor.policy.heard)
            counted[name] = phases[1]
        assert all(torch.equal(a, b) for a, b in zip(outs["resident"], outs["planned"]))
        experts = 3 if tokens == 2 else 2  # distinct experts a layer: [4, 1] + [4, 6], or [4, 1]
        assert heard["resident"] == heard["planned"] and len(heard["planned"]) == (1 + experts) * len(spec.moe_layers)
        assert counted["resident"] == counted["planned"]
        assert (counted["resident"].hits, counted["resident"].loads) == (experts * len(spec.moe_layers), 0)
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
