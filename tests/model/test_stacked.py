"""Stacked q/k/v: which layers stack, and a model whose layers stack computes what it computes unstacked, bit for bit
(each output row's dot product is its own), with the native bf16 kernels and with quantized dense weights."""

import pytest
import torch

import moetier.engine.engine as engine_module
from moetier import Engine
from moetier.engine.stats import GenerationStats
from moetier.model import native
from moetier.model.batch import StepBatch
from moetier.model.dense_quant import QuantizedMatrix, quantize_matrix
from moetier.model.kv_cache import KVCache
from moetier.model.stacked import Stacked, materialized, stack_qkv
from moetier.plan.route import DECODE, PREFILL


def test_which_layers_stack():
    g = torch.Generator().manual_seed(0)
    m = lambda n: torch.randn(n, 32, generator=g)  # noqa: E731
    shared = m(16)
    dense = {"layers.0.q_proj": m(16), "layers.0.k_proj": m(8), "layers.0.v_proj": m(8),  # stacks
             "layers.0.q_proj.bias": torch.ones(16), "layers.0.k_proj.bias": torch.ones(8),
             "layers.0.v_proj.bias": torch.ones(8),
             "layers.1.q_proj": m(16), "layers.1.k_proj": m(8), "layers.1.v_proj": m(8),  # one bias of three
             "layers.1.q_proj.bias": torch.ones(16),
             "layers.2.q_proj": quantize_matrix(m(16), "int4"), "layers.2.k_proj": m(8), "layers.2.v_proj": m(8),
             "layers.3.q_proj": m(16),  # latent attention: no k_proj, v_proj
             "layers.4.q_proj": shared, "layers.4.k_proj": m(8), "layers.4.v_proj": m(8), "tied": shared,
             "layers.5.q_proj": m(16), "layers.5.k_proj": torch.randn(8, 16, generator=g), "layers.5.v_proj": m(8)}
    out = stack_qkv(dense, 6)
    assert isinstance(out["layers.0.qkv_proj"], Stacked) and isinstance(out["layers.0.qkv_proj.bias"], Stacked)
    assert not any(f"layers.0.{n}_proj{b}" in out for n in "qkv" for b in ("", ".bias"))
    for i in range(1, 6):
        assert f"layers.{i}.qkv_proj" not in out and f"layers.{i}.q_proj" in out
    made = materialized(out)
    assert torch.equal(made["layers.0.qkv_proj"], torch.cat([dense[f"layers.0.{n}_proj"] for n in "qkv"]))
    assert made["layers.0.qkv_proj.bias"].shape == (32,) and not out  # (materialized empties what it is given)


def test_quantized_parts_stack_into_one_quantized_matrix():
    g = torch.Generator().manual_seed(1)
    parts = [quantize_matrix(torch.randn(n, 256, generator=g), "int4") for n in (64, 32, 32)]
    made = Stacked(tuple(parts)).build()
    assert isinstance(made, QuantizedMatrix) and made.shape == (128, 256) and made.group == parts[0].group
    assert torch.equal(made.q.codes[64:96], parts[1].q.codes) and torch.equal(made.q.zeros[96:], parts[2].q.zeros)
    with pytest.raises(ValueError):
        Stacked((parts[0], quantize_matrix(torch.randn(32, 256, generator=g), "int8")))


def logits(path, kernels: str, dense_precision: str, stacked: bool, monkeypatch) -> list[torch.Tensor]:
    """A 3-token prefill's logits and two decode steps', from an engine with or without stacked q/k/v."""
    with monkeypatch.context() as m:
        if not stacked:
            m.setattr(engine_module, "stack_qkv", lambda dense, num_layers: dense)
        engine = Engine.from_pretrained(path, expert_memory="100%", kernels=kernels, dense_precision=dense_precision,
                                        progress=False)
    with engine:
        assert (engine.model.attn[0].qkv_proj is not None) == stacked
        prompt = [5, 9, 13]
        kv, stats = KVCache(engine.spec, 1, 16, torch.bfloat16), GenerationStats()
        engine.executor.begin_step(PREFILL, stats.phases)
        out = [engine.model.forward(StepBatch.prefill([prompt], [0]), kv, all_logits=True)]
        for i, token in enumerate((7, 11)):
            engine.executor.begin_step(DECODE, stats.phases)
            out.append(engine.model.forward(StepBatch.decode_step([token], [0], [len(prompt) + i], 1), kv))
    return out


@pytest.mark.skipif(native.load().lib is None, reason="no native kernels on this machine")
@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])  # (one norm over q's heads; q/k/v biases)
@pytest.mark.parametrize("dense_precision", ["native", "int4"])
def test_a_stacked_model_computes_what_it_computes_unstacked(tiny_store, monkeypatch, family, dense_precision):
    _, path = tiny_store(family, dtype=torch.bfloat16)
    stacked = logits(path, "native", dense_precision, True, monkeypatch)
    separate = logits(path, "native", dense_precision, False, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(stacked, separate))
