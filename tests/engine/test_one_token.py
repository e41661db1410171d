"""A planned layer of one token whose experts all hit goes through the kernels' one-token call (OneToken, chosen by
LayerPlan.one_token_order) instead of grouping its pairs: the same output bit for bit."""

import numpy as np
import pytest
import torch

from moetier.engine.expert_executor import ExpertExecutor
from moetier.engine.hit_layer import HitLayer
from moetier.engine.one_token import OneToken
from moetier.model import native
from moetier.store.store import Store


def layer_outputs(monkeypatch, path, precision: str, kernels: str, one_token: bool) -> tuple[list, list, int]:
    """Greedy decoding of two prompts at 60% of the experts: each MoE layer's output as the executor returned it,
    the tokens, and how many layers went through the one-token call (`one_token` False: every plan grouped)."""
    from moetier import Engine
    from moetier.config import MemoryBudget
    from moetier.engine.engine import EngineConfig
    from moetier.plan.layer_plan import LayerPlan
    from moetier.plan.precision import MixedPrecision

    monkeypatch.setattr(HitLayer, "__call__", lambda self, *args: None)  # (every layer planned)
    if not one_token:
        monkeypatch.setattr(LayerPlan, "one_token_order", lambda self: None)
    outs, calls = [], []
    carry_out, one = ExpertExecutor.carry_out, OneToken.compute_layer

    def recorded(self, *args, **kwargs):
        out = carry_out(self, *args, **kwargs)
        outs.append(out.clone())
        return out

    def counted(self, *args, **kwargs):
        calls.append(1)
        return one(self, *args, **kwargs)

    monkeypatch.setattr(ExpertExecutor, "carry_out", recorded)
    monkeypatch.setattr(OneToken, "compute_layer", counted)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (9, 4)]
    config = EngineConfig(expert_memory=MemoryBudget.parse("60%"), kernels=kernels,
                          precision=MixedPrecision(precision))
    with Engine(Store(path), config, progress=False) as engine:
        tokens = [engine.generate([p], max_new_tokens=12, ignore_eos=True).token_ids[0] for p in prompts]
    monkeypatch.undo()
    return outs, tokens, len(calls)


@pytest.mark.parametrize("precision", ["native", "int8", "int4", "q4_k", "q8_0"])
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_one_token_whose_experts_all_hit_is_the_grouped_plan_bit_for_bit(wide_quantized, monkeypatch, precision,
                                                                       kernels):
    """A decode layer whose experts are all resident at one precision goes through the kernel's one-token call
    (LayerPlan.one_token_order) instead of grouping its pairs: every layer's output equal to what the grouped path
    computes, bit for bit — the bf16 rows, the integer kernels from int8/int4 codes and GGML's blocks with the
    native library, and torch's ops."""
    if kernels == "auto" and native.load().lib is None:
        pytest.skip(f"no native kernels: {native.load().reason}")
    grouped, tokens, none = layer_outputs(monkeypatch, wide_quantized, precision, kernels, one_token=False)
    direct_, direct_tokens, calls = layer_outputs(monkeypatch, wide_quantized, precision, kernels, one_token=True)
    assert none == 0 and calls >= 10  # (of 2 x 2 x 11 decode layers, those whose experts all hit)
    assert direct_tokens == tokens and len(direct_) == len(grouped)
    assert all(torch.equal(a, b) for a, b in zip(direct_, grouped))


def test_the_one_call_computes_every_expert_of_the_token_or_none():
    calls = []

    class Kernel:
        def token(self, out, x, weights, ws, combine):
            calls.append((weights.tolist(), len(ws)))
            out.fill_(1.0)

    one = OneToken(torch.zeros(1, 4), np.array([0.25, 0.75], np.float32), torch.float32, combine=None)
    with pytest.raises(ValueError, match="all 2 of the token's experts, not 1"):
        one.compute_layer([3], Kernel(), [{}])
    one.compute_layer([3, 5], Kernel(), [{}, {}])
    assert calls == [([0.25, 0.75], 2)] and torch.equal(one.combine(), torch.ones(1, 4))
