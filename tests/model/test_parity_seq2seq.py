"""Exact mode for a text-to-text model (Switch Transformers): the decoder's logits equal transformers' (fp32) after
the encoder's pass and for 16 decode steps, and greedy generation gives the same tokens, under every expert budget
from one expert to all of them (the encoder's and the decoder's)."""

import pytest
import torch

from moetier.engine.stats import GenerationStats
from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.plan.route import DECODE, PREFILL
from moetier.store.store import Store
from tests.model.budgets import parity_budgets
from tests.model.test_parity import ATOL, engine_with_slots

CASES = [
    ({}, 1e-5),  # tied head (scaled by d_model^-0.5); blocks 1 and 3 of each stack sparse
    ({"tie_word_embeddings": False}, 1e-4),  # its own head and embeddings (larger logits: 1e-4 absolute)
    # every encoder block sparse, one decoder block; an expert takes 2 tokens of a prompt (the rest are dropped)
    ({"num_sparse_encoder_layers": 4, "num_sparse_decoder_layers": 1, "expert_capacity": 2}, 1e-5),
]


def reference_steps(ref, prompt: list[int], fed: list[int]):
    """The decoder's logits [V] after the start token and after each token of `fed`."""
    with torch.no_grad():
        encoded = ref.get_encoder()(input_ids=torch.tensor([prompt]))
        out = ref(encoder_outputs=encoded, decoder_input_ids=torch.tensor([[ref.config.decoder_start_token_id]]),
                  use_cache=True)
        logits, past = [out.logits[0, -1]], out.past_key_values
        for token in fed:
            out = ref(encoder_outputs=encoded, decoder_input_ids=torch.tensor([[token]]), past_key_values=past,
                      use_cache=True)
            logits.append(out.logits[0, -1])
            past = out.past_key_values
    return logits


def engine_steps(engine, prompt: list[int], fed: list[int]) -> list[torch.Tensor]:
    """The engine's decoder logits [V] after the encoder's pass and the start token, then after each of `fed`."""
    kv = KVCache(engine.spec, 1, 64, torch.float32)
    stats = GenerationStats()
    engine.executor.begin_step(PREFILL, stats.phases)
    steps = [engine.model.forward(StepBatch.prefill([prompt], [0]), kv)[0]]
    for i, token in enumerate(fed):
        engine.executor.begin_step(DECODE, stats.phases)
        steps.append(engine.model.forward(StepBatch.decode_step([token], [0], [len(prompt) + i], 1), kv)[0])
    return steps


@pytest.mark.parametrize("overrides,atol", CASES, ids=["tied", "untied", "capacity"])
def test_exact_mode_matches_transformers(tiny_store, every_budget, overrides, atol):
    assert atol <= ATOL
    ref, path = tiny_store("switch_transformers", **overrides)
    spec = Store(path).spec
    torch.manual_seed(1)
    prompt = torch.randint(3, spec.vocab_size, (11,)).tolist()
    fed = torch.randint(3, spec.vocab_size, (16,)).tolist()  # teacher-forced: a random tied model repeats a token
    expected = reference_steps(ref, prompt, fed)
    ref_greedy = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, 1:].tolist()
    assert len(ref_greedy) == 32 or ref_greedy[-1] == ref.config.eos_token_id

    hit_rates = []
    for slots in parity_budgets(spec.top_k, spec.num_expert_keys, every_budget):
        with engine_with_slots(path, slots) as engine:
            for i, (ours, theirs) in enumerate(zip(engine_steps(engine, prompt, fed), expected)):
                assert (ours - theirs).abs().max().item() <= atol, f"step {i} differs at {slots} slots"
            out = engine.generate([prompt], max_new_tokens=32, ignore_eos=True)
            assert out.token_ids[0][:len(ref_greedy)] == ref_greedy, f"greedy tokens differ at {slots} slots"
            hit_rates.append(out.stats["hit_rate"])
    assert hit_rates[-1] > hit_rates[0]


def test_a_batch_of_prompts_decodes_as_each_alone(tiny_store):
    """Prompts of different lengths in one batch: each sequence's tokens are those it gets alone."""
    _, path = tiny_store("switch_transformers", tie_word_embeddings=False)
    prompts = [[5, 9, 17, 33, 2, 70], [44, 3, 3, 90, 12, 7, 8, 61, 100, 4, 6], [11]]
    with engine_with_slots(path, 6) as engine:
        together = engine.generate(prompts, max_new_tokens=12, ignore_eos=True).token_ids
        alone = [engine.generate([p], max_new_tokens=12, ignore_eos=True).token_ids[0] for p in prompts]
    assert together == alone


def test_cache_holds_each_prompt_encoding(tiny_store):
    """Cross-attention keys and values per decoder layer, as long as each prompt; none for the encoder's blocks."""
    _, path = tiny_store("switch_transformers")
    spec = Store(path).spec
    kv = KVCache(spec, 2, 20, torch.float32)
    enc = spec.encoder_decoder.encoder_layers
    assert all(t is None for t in kv.k[:enc] + kv.cross_k[:enc])
    per_layer = 4 * 2 * spec.num_heads * 20 * spec.head_dim * 4  # self k, v and cross k, v; 2 rows of 20, fp32
    assert kv.nbytes == (spec.num_layers - enc) * per_layer


def test_lookahead_predictor_is_refused_before_anything_runs(tiny_store):
    from moetier.config import MemoryBudget
    from moetier.engine.engine import Engine, EngineConfig
    from moetier.errors import MoetierError

    _, path = tiny_store("switch_transformers")
    with pytest.raises(MoetierError, match="decoder-only"):
        Engine(Store(path), EngineConfig(expert_memory=MemoryBudget("share", 0.5), prefetch="smoe",
                                         predictor="smoe-lookahead"), progress=False)


def test_generate_prints_the_new_text_alone(tmp_path, capsys):
    """`moetier generate` on a text-to-text model: the decoder's text, not an echo of the prompt continued."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from moetier.cli import main
    from tests.tiny_models import build_tiny

    hf = tmp_path / "hf"
    ref = build_tiny("switch_transformers", hf, tie_word_embeddings=False)
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.save(str(hf / "tokenizer.json"))
    assert main(["generate", "--model", str(hf), "--prompt", "w5 w9 w17 w33", "--max-tokens", "6",
                 "--ignore-eos", "--temperature", "0"]) == 0  # (greedy, as the reference below)
    printed = capsys.readouterr().out.strip()
    expected = ref.generate(torch.tensor([[5, 9, 17, 33, 1]]), max_new_tokens=6, do_sample=False)[0, 1:].tolist()
    assert printed.split()[:len(expected)] == [tok.id_to_token(i) for i in expected]


def test_what_a_text_to_text_model_cannot_do_is_refused(tiny_store):
    """Logits per prompt token, continuing a prompt, and teacher-forced scoring: each refused, saying why."""
    from moetier.engine.score import teacher_forced
    from moetier.errors import MoetierError

    _, path = tiny_store("switch_transformers")
    with engine_with_slots(path, 8) as engine:
        kv = KVCache(engine.spec, 1, 16, torch.float32)
        with pytest.raises(MoetierError, match="one next-token distribution per sequence"):
            engine.model.forward(StepBatch.prefill([[5, 6, 7]], [0]), kv, all_logits=True)
        with pytest.raises(MoetierError, match="cannot continue one"):
            engine.model.forward(StepBatch.prefill([[5, 6, 7]], [0], starts=[3]), kv)
        with pytest.raises(MoetierError, match="reads its input with an encoder"):
            teacher_forced(engine, [5, 6, 7, 8, 9], prefix=2)


def test_offloading_the_encoder_alone_keeps_the_decoder_resident_and_exact(tiny_store):
    """CoMoE's encoder-focused offloading (--offload encoder): the decoder's experts are loaded first and never
    leave, the encoder's come and go through what the budget leaves them (a smaller share than the decoder's), and
    the tokens are exact mode's; a decoder-only model, a per-layer split and a budget that cannot hold the decoder's
    experts are refused."""
    from moetier.cache.keys import ExpertKey
    from moetier.config import MemoryBudget
    from moetier.engine.engine import Engine, EngineConfig
    from moetier.errors import BudgetError, MoetierError

    ref, path = tiny_store("switch_transformers")
    store = Store(path)
    spec, blob = store.spec, store.native_layout.blob_bytes
    first = spec.encoder_decoder.encoder_layers
    decoder = {ExpertKey(layer, e) for layer, e in spec.expert_keys() if layer >= first}  # 16 of 32
    prompts = [torch.randint(3, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (11, 7, 15)]
    expected = [ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, 1:].tolist() for p in prompts]
    config = EngineConfig(expert_memory=MemoryBudget("bytes", 20 * blob), offload="encoder")
    with Engine(store, config) as engine:
        residency = engine.executor.residency
        assert decoder <= set(residency.entries)  # loaded first
        for p, want in zip(prompts, expected):
            out = engine.generate([p], max_new_tokens=12, ignore_eos=True)
            assert out.token_ids[0][:len(want)] == want
            assert decoder <= set(residency.entries)  # never evicted
        encoder_held = [k for k in residency.entries if k.layer < first]
        assert len(encoder_held) <= 4 and out.stats["hit_rate"] < 1.0  # the encoder's 16 through 4 slots
    with pytest.raises(BudgetError, match="keeps the decoder's 16 experts resident"):
        Engine(store, EngineConfig(expert_memory=MemoryBudget("bytes", 16 * blob), offload="encoder"))
    _, olmoe = tiny_store("olmoe")
    with pytest.raises(MoetierError, match="this model is a decoder alone"):
        Engine(Store(olmoe), EngineConfig(offload="encoder"))
    with pytest.raises(MoetierError, match="one shared cache"):
        EngineConfig(offload="encoder", cache_partition="per-layer")
