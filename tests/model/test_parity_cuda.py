"""Exact mode on a GPU (`--device cuda`): the dense weights, the KV cache and the expert cache on the device, the
experts read from the store through pinned staging buffers and copied on a side stream (DeviceSlots). Logits equal
transformers' run on the same GPU (fp32) for prefill and every decode step, and greedy tokens are identical, at
three expert budgets: one layer's top-k (every layer misses), half the experts, and all of them. Skipped where
torch sees no CUDA device (CI has none); `bench/gpu/run.sh` runs them on the GPU machine."""

import copy

import pytest
import torch

from moetier.config import MemoryBudget
from moetier.engine.engine import Engine, EngineConfig
from moetier.engine.stats import GenerationStats
from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.plan.route import DECODE, PREFILL
from moetier.store.store import Store
from tests.model.test_parity import ATOL, CASES
from tests.model.test_parity_seq2seq import CASES as SEQ2SEQ_CASES

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu/run.sh)")]
DEVICE = "cuda"


def cuda_engine(path, slots: int) -> Engine:
    store = Store(path)
    budget = MemoryBudget("bytes", slots * store.native_layout.blob_bytes)
    return Engine(store, EngineConfig(expert_memory=budget, device=DEVICE), progress=False)


def three_budgets(spec) -> list[int]:
    """Slots: one layer's top-k, half the experts, all of them."""
    return sorted({spec.top_k, max(spec.top_k, spec.num_expert_keys // 2), spec.num_expert_keys})


def on_device(ref):
    """The reference on the GPU, as a copy (the session's fixture keeps the CPU one for the other tests)."""
    return copy.deepcopy(ref).to(DEVICE)


@pytest.mark.parametrize("family,overrides", CASES, ids=[f"{f}{'-' + '-'.join(o) if o else ''}" for f, o in CASES])
def test_exact_mode_on_the_gpu_matches_transformers_there(tiny_store, family, overrides):
    ref, path = tiny_store(family, **overrides)
    ref = on_device(ref)
    cfg = ref.config
    spec = Store(path).spec
    torch.manual_seed(1)
    prompt = torch.randint(3, cfg.vocab_size, (11,)).tolist()
    with torch.no_grad():
        out = ref(torch.tensor([prompt], device=DEVICE), use_cache=True)
        past, ref_steps, ref_tokens = out.past_key_values, [], []
        token = out.logits[0, -1].argmax().item()
        for _ in range(16):
            ref_tokens.append(token)
            o = ref(torch.tensor([[token]], device=DEVICE), past_key_values=past, use_cache=True)
            past = o.past_key_values
            ref_steps.append(o.logits[0, -1])
            token = o.logits[0, -1].argmax().item()
        ref_greedy = ref.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=32, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    hit_rates = []
    for slots in three_budgets(spec):
        with cuda_engine(path, slots) as engine:
            assert engine.model.device.type == "cuda" and engine.executor.pool.device.type == "cuda"
            kv = KVCache(engine.spec, 1, 64, torch.float32, DEVICE)
            stats = GenerationStats()
            engine.executor.begin_step(PREFILL, stats.phases)
            ours = engine.model.forward(StepBatch.prefill([prompt], [0], device=DEVICE), kv, all_logits=True)
            assert ours.device.type == "cuda"
            diff = (ours - out.logits[0]).abs().max().item()
            assert diff <= ATOL, f"prefill differs by {diff} at {slots} slots"
            for i, (token, expected) in enumerate(zip(ref_tokens, ref_steps)):
                engine.executor.begin_step(DECODE, stats.phases)
                step = engine.model.forward(StepBatch.decode_step([token], [0], [len(prompt) + i], 1, DEVICE), kv)
                diff = (step[0] - expected).abs().max().item()
                assert diff <= ATOL, f"decode step {i} differs by {diff} at {slots} slots"
            got = engine.generate([prompt], max_new_tokens=32, ignore_eos=True)
            assert got.token_ids[0][:len(ref_greedy)] == ref_greedy, f"greedy tokens differ at {slots} slots"
            hit_rates.append(got.stats["hit_rate"])
    assert hit_rates[-1] > hit_rates[0]  # the budgets were different caches


@pytest.mark.parametrize("overrides,atol", SEQ2SEQ_CASES, ids=["tied", "untied", "capacity"])
def test_a_text_to_text_model_on_the_gpu_matches_transformers_there(tiny_store, overrides, atol):
    ref, path = tiny_store("switch_transformers", **overrides)
    ref = on_device(ref)
    spec = Store(path).spec
    torch.manual_seed(1)
    prompt = torch.randint(3, spec.vocab_size, (11,)).tolist()
    fed = torch.randint(3, spec.vocab_size, (16,)).tolist()
    with torch.no_grad():
        encoded = ref.get_encoder()(input_ids=torch.tensor([prompt], device=DEVICE))
        start = torch.tensor([[ref.config.decoder_start_token_id]], device=DEVICE)
        o = ref(encoder_outputs=encoded, decoder_input_ids=start, use_cache=True)
        expected, past = [o.logits[0, -1]], o.past_key_values
        for token in fed:
            o = ref(encoder_outputs=encoded, decoder_input_ids=torch.tensor([[token]], device=DEVICE),
                    past_key_values=past, use_cache=True)
            expected.append(o.logits[0, -1])
            past = o.past_key_values
        ref_greedy = ref.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=32,
                                  do_sample=False)[0, 1:].tolist()
    for slots in three_budgets(spec):
        with cuda_engine(path, slots) as engine:
            kv = KVCache(engine.spec, 1, 64, torch.float32, DEVICE)
            stats = GenerationStats()
            engine.executor.begin_step(PREFILL, stats.phases)
            steps = [engine.model.forward(StepBatch.prefill([prompt], [0], device=DEVICE), kv)[0]]
            for i, token in enumerate(fed):
                engine.executor.begin_step(DECODE, stats.phases)
                steps.append(engine.model.forward(StepBatch.decode_step([token], [0], [len(prompt) + i], 1, DEVICE),
                                                  kv)[0])
            for i, (ours, theirs) in enumerate(zip(steps, expected)):
                diff = (ours - theirs).abs().max().item()
                assert diff <= atol, f"step {i} differs by {diff} at {slots} slots"
            got = engine.generate([prompt], max_new_tokens=32, ignore_eos=True)
            assert got.token_ids[0][:len(ref_greedy)] == ref_greedy, f"greedy tokens differ at {slots} slots"
