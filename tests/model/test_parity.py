"""Exact mode: our logits equal transformers' (fp32) for prefill and every decode step, and greedy tokens are
identical, under every expert budget from one layer's top-k to all experts."""

import pytest
import torch

from moetier.config import MemoryBudget
from moetier.engine.engine import Engine, EngineConfig
from moetier.engine.stats import GenerationStats
from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.plan.route import DECODE, PREFILL
from moetier.store.store import Store
from tests.model.budgets import parity_budgets

ATOL = 1e-4
CASES = [
    ("mixtral", {}),
    ("qwen2_moe", {}),
    ("qwen3_moe", {}),
    ("olmoe", {}),
    ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),  # a dense MLP layer between MoE layers
    ("mixtral", {"sliding_window": 6}),
    ("qwen3_moe", {"num_experts_per_tok": 3, "num_hidden_layers": 3}),
    # MLA without q compression, a dense first layer, a shared expert, greedy softmax routing scaled by 1.5
    ("deepseek_v2", {}),
    # V2-Lite's YaRN (mscale = mscale_all_dim = 0.707: the softmax scale changes, cos/sin do not)
    ("deepseek_v2", {"rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                                      "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1}}),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3,
                     "num_hidden_layers": 3}),
    # MLA with q compression, YaRN (mscale ≠ mscale_all_dim), noaux_tc over 2 groups, renormalised and scaled
    ("deepseek_v3", {}),
    ("deepseek_v3", {"q_lora_rank": None, "rope_interleave": False, "n_shared_experts": 0,
                     "first_k_dense_replace": 0, "num_experts_per_tok": 1, "rope_scaling": None}),
    # Moonlight's: no q compression, one group, two shared experts, top-6, scaled by 2.446, plain RoPE
    ("deepseek_v3", {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "n_shared_experts": 2,
                     "num_experts_per_tok": 6, "routed_scaling_factor": 2.446, "rope_scaling": None}),
    ("deepseek_v3", {"num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "attention_bias": True,
                     "num_hidden_layers": 3}),
    # partial RoPE, per-head q/k norms, q/k/v biases, V3's routing
    ("glm4_moe", {}),
    ("glm4_moe", {"use_qk_norm": False, "partial_rotary_factor": 1.0, "num_experts_per_tok": 4, "n_group": 1,
                  "topk_group": 1, "n_shared_experts": 2, "num_hidden_layers": 3}),
    # LayerNorm, biases, LongRoPE with the long scale reached while decoding, sparsemixer
    ("phimoe", {}),
    ("phimoe", {"sliding_window": 5, "rope_scaling": None, "lm_head_bias": False}),
    # attention sinks, alternating sliding windows, YaRN, biased top-k-softmax router, clamped SwiGLU with biases
    ("gpt_oss", {}),
    ("gpt_oss", {"num_experts_per_tok": 4, "num_hidden_layers": 3, "sliding_window": 3,
                 "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
]


def engine_with_slots(store_path, slots: int) -> Engine:
    store = Store(store_path)
    budget = MemoryBudget("bytes", slots * store.native_layout.blob_bytes)
    return Engine(store, EngineConfig(expert_memory=budget))


def reference_run(ref, prompt: list[int], steps: int):
    """Prefill logits, then `steps` greedy decode steps: (prefill logits [T, V], [step logits [V]], tokens)."""
    with torch.no_grad():
        out = ref(torch.tensor([prompt]), use_cache=True)
        past, logits, tokens = out.past_key_values, [], []
        token = out.logits[0, -1].argmax().item()
        for _ in range(steps):
            tokens.append(token)
            o = ref(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past = o.past_key_values
            logits.append(o.logits[0, -1])
            token = o.logits[0, -1].argmax().item()
    return out.logits[0], logits, tokens


@pytest.mark.parametrize("family,overrides", CASES, ids=[f"{f}{'-' + '-'.join(o) if o else ''}" for f, o in CASES])
def test_exact_mode_matches_transformers(tiny_store, every_budget, family, overrides):
    ref, path = tiny_store(family, **overrides)
    cfg = ref.config
    top_k = cfg.num_experts_per_tok
    num_moe_layers = Store(path).spec.num_expert_keys // Store(path).spec.num_experts
    all_experts = num_moe_layers * Store(path).spec.num_experts
    torch.manual_seed(1)
    prompt = torch.randint(3, cfg.vocab_size, (11,)).tolist()
    ref_prefill, ref_steps, ref_tokens = reference_run(ref, prompt, 16)
    ref_greedy = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert len(ref_greedy) == 32 or ref_greedy[-1] == cfg.eos_token_id

    budgets = parity_budgets(top_k, all_experts, every_budget)
    hit_rates = []
    for slots in budgets:
        with engine_with_slots(path, slots) as engine:
            kv = KVCache(engine.spec, 1, 64, torch.float32)
            stats = GenerationStats()
            engine.executor.begin_step(PREFILL, stats.phases)
            ours = engine.model.forward(StepBatch.prefill([prompt], [0]), kv, all_logits=True)
            assert (ours - ref_prefill).abs().max().item() <= ATOL, f"prefill differs at {slots} slots"
            for i, (token, expected) in enumerate(zip(ref_tokens, ref_steps)):
                engine.executor.begin_step(DECODE, stats.phases)
                step = engine.model.forward(StepBatch.decode_step([token], [0], [len(prompt) + i], 1), kv)
                assert (step[0] - expected).abs().max().item() <= ATOL, f"decode step {i} differs at {slots} slots"
            out = engine.generate([prompt], max_new_tokens=32, ignore_eos=True)
            # (transformers stops at an end-of-sequence token; ours ran on past it)
            assert out.token_ids[0][:len(ref_greedy)] == ref_greedy, f"greedy tokens differ at {slots} slots"
            hit_rates.append(out.stats["hit_rate"])
    # the budgets really were different caches: all experts resident hits more than one layer's top-k
    assert hit_rates[-1] > hit_rates[0]


def test_the_parity_check_for_a_users_checkpoint_runs(tiny_store, tmp_path):
    """bench/check_parity.py (README: checking exact mode on one's own checkpoint) on a converted folder."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    _, store = tiny_store("phimoe")
    hf = Path(store).parent / "hf"
    out = tmp_path / "parity.json"
    script = Path(__file__).resolve().parents[2] / "bench" / "check_parity.py"
    done = subprocess.run([sys.executable, str(script), "--model", str(hf), "--expert-memory", "1%,50%,100%",
                           "--steps", "4", "--tokens", "8", "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["expert_memory"] for r in rows] == ["50%", "100%"]  # 1% holds no layer's top-k: said, skipped
    assert "1%: expert memory 1%" in done.stderr
    assert all(r["max_abs_logit_diff"] <= ATOL and r["greedy_tokens_equal"] == r["greedy_tokens"] for r in rows)
