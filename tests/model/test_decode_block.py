"""The native decode block: a one-sequence decode step with each layer's attention in one call gives the logits
the layer-by-layer forward gives, bit for bit, in every family whose attention it computes; elsewhere it does not
apply and the layer-by-layer forward runs."""

import pytest
import torch

from moetier import Engine
from moetier.engine.stats import GenerationStats
from moetier.model import native
from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.plan.route import DECODE, PREFILL

pytestmark = pytest.mark.skipif(native.load().lib is None, reason="no native kernels on this machine")


def decode_logits(engine, blocks: bool, steps: int = 6, max_len: int = 16) -> list[torch.Tensor]:
    """A 3-token prefill, then `steps` decode steps (each feeding back its greedy token): every step's logits."""
    model = engine.model
    saved, model.blocks = model.blocks, model.blocks if blocks else None
    try:
        prompt = [5, 9, 13]
        kv, stats = KVCache(engine.spec, 2, max_len, torch.bfloat16), GenerationStats()
        engine.executor.begin_step(PREFILL, stats.phases)
        out = [model.forward(StepBatch.prefill([prompt], [1]), kv)]
        for i in range(steps):
            engine.executor.begin_step(DECODE, stats.phases)
            token = int(out[-1][0].float().argmax())
            out.append(model.forward(StepBatch.decode_step([token], [1], [len(prompt) + i], 2), kv))
    finally:
        model.blocks = saved
    return out


@pytest.mark.parametrize("family,overrides,dense_precision", [
    ("olmoe", {}, "native"),  # one norm over all heads' q and k
    ("qwen3_moe", {}, "native"),  # a norm per head; renormalised top-k
    ("qwen2_moe", {}, "native"),  # q/k/v biases; a gated shared expert
    ("mixtral", {"sliding_window": 4}, "native"),  # a window the context outgrows
    ("olmoe", {"hidden_size": 128}, "int4"),  # quantized attention products (their integer kernel's shapes)
    ("qwen2_moe", {"hidden_size": 128}, "int8"),  # ... with biases added to the rounded products
])
@pytest.mark.parametrize("budget", ["100%", "50%"])  # resident layers; planned layers with reads
def test_the_block_gives_the_layer_by_layer_logits_bit_for_bit(tiny_store, family, overrides, dense_precision,
                                                                budget):
    _, path = tiny_store(family, dtype=torch.bfloat16, **overrides)
    engine = Engine.from_pretrained(path, expert_memory=budget, kernels="native", dense_precision=dense_precision,
                                    progress=False)
    with engine:
        assert engine.model.blocks is not None
        fused = decode_logits(engine, blocks=True)
        layered = decode_logits(engine, blocks=False)
    assert len(fused) == len(layered) == 7
    for a, b in zip(fused, layered):
        assert torch.equal(a, b)


def test_smoes_lookahead_from_a_blocks_residual_leaves_the_logits_exact(tiny_store, monkeypatch):
    """The look-ahead predictor runs the next layer's attention on the residual the blocks keep (`_h`) while a
    layer's experts run: the blocks' step still gives the layer-by-layer logits."""
    _, path = tiny_store("olmoe", dtype=torch.bfloat16, num_hidden_layers=3)
    engine = Engine.from_pretrained(path, expert_memory="50%", kernels="native", prefetch="smoe",
                                    predictor="smoe-lookahead", progress=False)
    looked = []
    lookahead = type(engine.model).lookahead
    monkeypatch.setattr(type(engine.model), "lookahead", lambda *a: looked.append(a[1:]) or lookahead(*a))
    with engine:
        assert engine.model.blocks is not None
        fused = decode_logits(engine, blocks=True)
        assert looked  # (the predictor did look ahead during the blocks' steps)
        layered = decode_logits(engine, blocks=False)
    assert all(torch.equal(a, b) for a, b in zip(fused, layered))


def test_the_block_writes_the_cache_the_layers_write(tiny_store):
    _, path = tiny_store("olmoe", dtype=torch.bfloat16)
    engine = Engine.from_pretrained(path, expert_memory="100%", kernels="native", progress=False)
    caches = []
    with engine:
        for blocks in (True, False):
            model = engine.model
            saved, model.blocks = model.blocks, model.blocks if blocks else None
            kv, stats = KVCache(engine.spec, 1, 8, torch.bfloat16), GenerationStats()
            engine.executor.begin_step(PREFILL, stats.phases)
            model.forward(StepBatch.prefill([[3, 4]], [0]), kv)
            engine.executor.begin_step(DECODE, stats.phases)
            model.forward(StepBatch.decode_step([7], [0], [2], 1), kv)
            model.blocks = saved
            caches.append(kv)
    for layer in range(engine.spec.num_layers):
        assert caches[0].k[layer][0, :, 2].abs().sum() > 0  # the decode token's keys were written
        assert torch.equal(caches[0].k[layer], caches[1].k[layer])
        assert torch.equal(caches[0].v[layer], caches[1].v[layer])


@pytest.mark.parametrize("family,kernels,dense_precision,overrides", [
    ("olmoe", "torch", "native", {}),  # the torch kernels
    ("olmoe", "native", "int4", {"hidden_size": 48}),  # quantized products the integer kernel does not take
    ("glm4_moe", "native", "native", {}),  # half-head RoPE, a sigmoid router
    ("deepseek_v2", "native", "native", {}),  # latent attention
    ("phimoe", "native", "native", {}),  # LayerNorm
    ("gpt_oss", "native", "native", {}),  # sinks
])
def test_where_the_block_does_not_apply_the_layers_run(tiny_store, monkeypatch, family, kernels, dense_precision,
                                                       overrides):
    _, path = tiny_store(family, dtype=torch.bfloat16, **overrides)
    engine = Engine.from_pretrained(path, expert_memory="100%", kernels=kernels, dense_precision=dense_precision,
                                    progress=False)
    monkeypatch.setattr(type(engine.model), "_forward_blocks", lambda *a: pytest.fail("the blocks ran"))
    with engine:
        assert (engine.model.blocks is None) == (family != "glm4_moe")  # (GLM's blocks exist; its RoPE says no)
        assert len(decode_logits(engine, blocks=True, steps=2)) == 3


def batch_logits(engine, blocks: bool, rows: list[int], steps: int = 4, max_len: int = 24) -> list[torch.Tensor]:
    """Prompts of different lengths in cache rows `rows` (any order), then `steps` decode steps of all of them
    together (each feeding back its greedy token): every step's logits [B, V]."""
    model = engine.model
    saved, model.blocks = model.blocks, model.blocks if blocks else None
    try:
        prompts = [[3 + 2 * b + j for j in range(2 + b % 3)] for b in range(len(rows))]
        kv, stats = KVCache(engine.spec, max(rows) + 1, max_len, torch.bfloat16), GenerationStats()
        engine.executor.begin_step(PREFILL, stats.phases)
        out = [model.forward(StepBatch.prefill(prompts, rows), kv)]
        positions = [len(p) for p in prompts]
        for _ in range(steps):
            engine.executor.begin_step(DECODE, stats.phases)
            tokens = out[-1].float().argmax(-1).tolist()
            out.append(model.forward(StepBatch.decode_step(tokens, rows, positions, max(rows) + 1), kv))
            positions = [p + 1 for p in positions]
    finally:
        model.blocks = saved
    return out


@pytest.mark.parametrize("family,overrides,dense_precision", [
    ("olmoe", {}, "native"),
    ("qwen3_moe", {}, "native"),
    ("qwen2_moe", {}, "native"),
    ("mixtral", {"sliding_window": 4}, "native"),
    ("olmoe", {"hidden_size": 128}, "int4"),
    ("qwen2_moe", {"hidden_size": 128}, "int8"),
])
@pytest.mark.parametrize("budget", ["100%", "50%"])
def test_a_batchs_blocks_give_the_layer_by_layer_logits_bit_for_bit(tiny_store, family, overrides, dense_precision,
                                                                    budget):
    """A decode step of several sequences (a server's batch) with each layer's attention for all of them in one call
    (moetier_decode_block_rows): each at its own position and cache row (rows out of order, contexts of different
    lengths), the logits the layer-by-layer forward gives, bit for bit."""
    _, path = tiny_store(family, dtype=torch.bfloat16, **overrides)
    engine = Engine.from_pretrained(path, expert_memory=budget, kernels="native", dense_precision=dense_precision,
                                    progress=False)
    with engine:
        assert engine.model.blocks is not None
        rows = [2, 0, 3]
        fused = batch_logits(engine, blocks=True, rows=rows)
        layered = batch_logits(engine, blocks=False, rows=rows)
    assert len(fused) == len(layered) == 5 and fused[-1].shape[0] == 3
    for a, b in zip(fused, layered):
        assert torch.equal(a, b)


def test_a_batchs_blocks_run_only_up_to_their_rows(tiny_store, monkeypatch):
    """BLOCK_ROWS sequences through the blocks; one more runs the layers (whose products would leave the codes for
    the GEMM somewhere past it)."""
    from moetier.model.decode_block import BLOCK_ROWS

    _, path = tiny_store("olmoe", dtype=torch.bfloat16)
    engine = Engine.from_pretrained(path, expert_memory="100%", kernels="native", progress=False)
    with engine:
        model = engine.model
        calls = []
        forward_blocks = type(model)._forward_blocks
        monkeypatch.setattr(type(model), "_forward_blocks", lambda *a: calls.append(len(a[1].rows_host))
                            or forward_blocks(*a))
        for n in (BLOCK_ROWS, BLOCK_ROWS + 1):
            rows = list(range(n))
            kv, stats = KVCache(engine.spec, n, 8, torch.bfloat16), GenerationStats()
            engine.executor.begin_step(PREFILL, stats.phases)
            model.forward(StepBatch.prefill([[3, 4]] * n, rows), kv)
            engine.executor.begin_step(DECODE, stats.phases)
            assert model.forward(StepBatch.decode_step([7] * n, rows, [2] * n, n), kv).shape[0] == n
    assert calls == [BLOCK_ROWS]