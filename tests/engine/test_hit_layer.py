"""A planned layer whose experts all hit (one token's, or a batch's and a prompt's), where only on-demand planning
runs, skips its plan (HitLayer): the same outputs bit for bit, the same calls to the policy in the same order, the same counters — and
every layer is planned again where a hook needs plans."""

import pytest
import torch

from moetier import Engine
from moetier.cache.policies import DEFAULT_POLICY, POLICIES
from moetier.config import MemoryBudget
from moetier.engine.engine import EngineConfig
from moetier.engine.expert_executor import ExpertExecutor
from moetier.engine.hit_layer import HitLayer
from moetier.plan.step import LayerHook
from moetier.store.store import Store


class RouteListener(LayerHook):
    needs_plans = False

    def __init__(self) -> None:
        self.heard = []

    def on_route(self, route, gate_input) -> None:
        self.heard.append((route.layer, route.topk_ids.tolist(), gate_input is not None))


class PlanListener(RouteListener):
    needs_plans = True

    def on_plan(self, plan, phase) -> None:
        self.heard.append(("plan", plan.layer))


def decode(monkeypatch, path, skip: bool, hook: LayerHook | None = None) -> dict:
    """Greedy decoding of two prompts at 60% of the experts with the default policy, one after the other and then
    together: each MoE layer's output, the policy's calls, the counters, and how many layers of one token and of
    more skipped planning (`skip` False: none may)."""
    policy_class = POLICIES[DEFAULT_POLICY]
    calls, outs, skipped = [], [], []
    on_route, on_access, call, hit = (policy_class.on_route, policy_class.on_access, ExpertExecutor.__call__,
                                      HitLayer.__call__)

    def heard_route(self, route):
        calls.append(("route", route.layer, route.topk_ids.tolist()))
        return on_route(self, route)

    def heard_access(self, key, precision, step):
        calls.append(("access", key, precision))
        return on_access(self, key, precision, step)

    def recorded(self, *args, **kwargs):
        out = call(self, *args, **kwargs)
        outs.append(out.clone())
        return out

    def counted(self, route, *args):
        out = hit(self, route, *args) if skip else None
        if out is not None:
            skipped.append(route.topk_ids.shape[0])
        return out

    monkeypatch.setattr(policy_class, "on_route", heard_route)
    monkeypatch.setattr(policy_class, "on_access", heard_access)
    monkeypatch.setattr(ExpertExecutor, "__call__", recorded)
    monkeypatch.setattr(HitLayer, "__call__", counted)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (9, 5)]
    with Engine(Store(path), EngineConfig(expert_memory=MemoryBudget.parse("60%")), progress=False) as engine:
        if hook is not None:
            engine.executor.layer_step.hooks.append(hook)
        results = [engine.generate([p], max_new_tokens=12, ignore_eos=True) for p in prompts]
        results.append(engine.generate(prompts, max_new_tokens=12, ignore_eos=True))  # (decoded together)
    monkeypatch.undo()
    return dict(outs=outs, calls=calls, skipped=sum(t == 1 for t in skipped), batched=sum(t > 1 for t in skipped),
                tokens=[r.token_ids for r in results], counters=[(r.stats["prefill"], r.stats["decode"]) for r in results])


@pytest.fixture(scope="module")
def path(tiny_store):
    return tiny_store("olmoe", dtype=torch.bfloat16, num_hidden_layers=3)[1]


def test_a_layer_whose_experts_all_hit_is_what_its_plan_computes_hears_and_counts(path, monkeypatch):
    planned = decode(monkeypatch, path, skip=False)
    direct = decode(monkeypatch, path, skip=True)
    assert planned["skipped"] == planned["batched"] == 0
    assert direct["skipped"] >= 10 and direct["batched"] >= 5  # (one token a layer; two decoded together, a prompt)
    assert direct["tokens"] == planned["tokens"] and len(direct["outs"]) == len(planned["outs"])
    assert all(torch.equal(a, b) for a, b in zip(direct["outs"], planned["outs"]))
    assert direct["calls"] == planned["calls"]
    assert direct["counters"] == planned["counters"]


def test_route_listeners_hear_every_layer_and_a_hook_that_needs_plans_gets_every_plan(path, monkeypatch):
    listener = RouteListener()
    direct = decode(monkeypatch, path, skip=True, hook=listener)
    planned_listener = RouteListener()
    decode(monkeypatch, path, skip=False, hook=planned_listener)
    assert direct["skipped"] >= 10 and listener.heard == planned_listener.heard
    plans = PlanListener()
    with_plans = decode(monkeypatch, path, skip=True, hook=plans)
    assert with_plans["skipped"] == with_plans["batched"] == 0  # (HitLayer never asked: every layer planned)
    assert sum(1 for h in plans.heard if h[0] == "plan") == sum(1 for h in plans.heard if h[0] != "plan") > 0
