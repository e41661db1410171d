"""The KV cache of latent-attention models holds each token's compressed latent and rotary key, not expanded
heads: measured in bytes per token against the formula, and read back against transformers' own cache."""

import torch

from moetier.config import MemoryBudget
from moetier.engine.engine import Engine, EngineConfig
from moetier.engine.stats import GenerationStats
from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.plan.route import PREFILL
from moetier.store.store import Store


def test_mla_cache_holds_the_latent_bytes_per_token(tiny_store):
    _, path = tiny_store("deepseek_v3")
    spec = Store(path).spec
    mla = spec.latent_attention
    rows, max_len = 3, 40
    for dtype in (torch.float32, torch.bfloat16):
        kv = KVCache(spec, rows, max_len, dtype)
        per_token = kv.nbytes / (rows * max_len)
        assert per_token == spec.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * dtype.itemsize
        expanded = spec.num_layers * spec.num_heads * (mla.qk_head_dim + mla.v_head_dim) * dtype.itemsize
        assert per_token * 4 == expanded  # (32 + 8 against 4 heads × (24 + 16) here; 576 against 40960 in V3)


def test_gqa_cache_bytes_per_token(tiny_store):
    _, path = tiny_store("qwen3_moe")
    spec = Store(path).spec
    kv = KVCache(spec, 2, 16, torch.float32)
    assert kv.nbytes / (2 * 16) == spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4


def test_mla_cache_equals_transformers_cached_latent(tiny_store):
    ref, path = tiny_store("deepseek_v3")
    torch.manual_seed(3)
    prompt = torch.randint(3, ref.config.vocab_size, (9,)).tolist()
    with torch.no_grad():
        past = ref(torch.tensor([prompt]), use_cache=True).past_key_values
    with Engine(Store(path), EngineConfig(expert_memory=MemoryBudget("share", 1.0)), progress=False) as engine:
        kv = KVCache(engine.spec, 1, 16, torch.float32)
        engine.executor.begin_step(PREFILL, GenerationStats().phases)
        engine.model.forward(StepBatch.prefill([prompt], [0]), kv)
    r = engine.spec.latent_attention.kv_lora_rank
    for layer in range(engine.spec.num_layers):
        latent, k_rope = past.layers[layer].keys, past.layers[layer].values  # [1, 1, T, r], [1, 1, T, rope]
        ours = kv.k[layer][:, :, :len(prompt)]
        assert torch.allclose(ours[..., :r], latent, atol=1e-6)
        assert torch.allclose(ours[..., r:], k_rope, atol=1e-6)
        assert not kv.k[layer][:, :, len(prompt):].any()  # nothing written past the prompt
