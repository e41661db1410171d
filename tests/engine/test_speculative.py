"""Speculative decoding (moetier/engine/speculative.py, decoding.py): prompt lookup on hand-made contexts, the gate
on hand-made costs, the rejection rule's distribution on hand-made logits, and greedy output token for token the
same as plain decoding's on every decoder family's tiny checkpoint."""

from types import SimpleNamespace

import pytest
import torch

from moetier import Engine
from moetier.engine.decoding import SpeculativeDecode
from moetier.engine.sampling import SamplingParams
from moetier.engine.speculative import Draft, Gate, NgramIndex, Rate, Speculation, StepCosts, expected_tokens
from moetier.errors import MoetierError


def test_prompt_lookup_drafts_what_followed_the_longest_earlier_match():
    spec = Speculation(tokens=3, max_ngram=3)
    index = NgramIndex(spec, [5, 6, 7, 8, 9, 1, 2, 6, 7])
    assert index.draft() == Draft([8, 9, 1], 2)  # "6 7" came before, followed by 8 9 1
    index.extend([8, 4])
    assert index.draft() == Draft([], 0)  # "4" never came before (nor "8 4", "7 8 4")
    index.extend([5, 6])
    assert index.draft().tokens == [7, 8, 9]  # "5 6" came at the start (the longer match before "6" alone: 7 8 4)
    assert NgramIndex(spec, [1, 2, 3]).draft().tokens == [] and NgramIndex(spec, []).draft().tokens == []
    longest = NgramIndex(spec, [1, 2, 9, 3, 2, 8, 1, 2])  # "1 2" -> 9 beats "2" -> 8 (the latest "2")
    assert longest.draft() == Draft([9, 3, 2], 2)
    loop = NgramIndex(spec, [7, 1, 2, 1, 2])  # "1 2" came 2 tokens back, followed by "1 2" and the end:
    assert loop.draft().tokens == [1, 2, 1]  # it goes on with period 2 (not a 2-token draft)
    assert NgramIndex(spec, [3, 3]).draft() == Draft([3, 3, 3], 1)
    with pytest.raises(MoetierError):
        Speculation(tokens=0)
    with pytest.raises(MoetierError):
        Speculation(min_ngram=3, max_ngram=2)


def test_the_gate_verifies_the_draft_length_that_pays_and_probes_when_none_does():
    spec = Speculation(tokens=4, probe_every=3, margin=1.05)
    costs, gate = StepCosts(), Gate(spec)
    four = Draft([5, 6, 7, 8], 3)
    assert gate.length(four, costs) == 0  # no plain step measured yet: one first
    costs.heard_plain(0.010)
    assert gate.length(four, costs) == 1  # no verify step measured yet: one draft token, to measure
    assert gate.length(Draft([], 0), costs) == 0
    costs.heard_verify(0.016, 1)  # a draft token cost 0.6 plain steps
    assert costs.c == pytest.approx(0.6)
    assert gate.length(four, costs) == 1  # the prior (a draft kept 80%): 1 pays best (1.8 / 1.6)
    assert Gate(Speculation(tokens=4, margin=1.15)).length(four, costs) == 0  # (1.125 is not 15% better)
    assert expected_tokens(0.5, 2) == 1.75
    for _ in range(12):
        costs.heard_verify(0.050, 4)  # 4 drafts cost 4 more plain steps: c moves from 0.6 toward 1
    assert costs.c == pytest.approx(1.0, abs=0.03)
    gate.heard(3, 4, 4)
    assert gate.length(four, costs) == 0  # at c ~ 1 even a kept draft costs what it gives: plain steps
    assert [gate.length(four, costs) for _ in range(3)] == [0, 0, 1]  # ... and one draft token after 3 plain steps
    gate.heard(3, 1, 0)
    assert gate.length(four, costs) == 0
    cheap = StepCosts()
    cheap.heard_plain(0.010)
    cheap.heard_verify(0.0112, 4)  # the step's fixed work dominates: a token costs 0.03 steps
    half = Gate(spec)  # (a draft kept 70%: four pay best)
    half.rates[3].kept, half.rates[3].refused = 7.0, 3.0
    assert half.rates[3].accept == pytest.approx(0.7)
    assert half.length(four, cheap) == 4 and half.length(Draft([5], 3), cheap) == 1


def test_a_draft_tokens_chance_is_counted_from_kept_tokens_and_first_refusals_for_each_match_length():
    rate = Rate()
    rate.heard(1, 0)  # one refusal, first thing: the prior's weight keeps the rate up
    assert 0.6 < rate.accept < 0.65
    steady = Rate()
    for _ in range(60):  # each step: 4 drafted, 3 kept, the 4th refused — a token kept 3 times in 4
        steady.heard(4, 3)
    assert steady.accept == pytest.approx(0.75, abs=0.01)  # (kept over drafted would say the same here ...)
    for _ in range(60):
        steady.heard(4, 0)  # ... but not here: refused at once, 4 drafts say one thing
    assert steady.accept < 0.02
    for _ in range(60):
        steady.heard(2, 2)  # every draft kept: nothing refused
    assert steady.accept > 0.98
    costs = StepCosts()
    costs.heard_plain(0.010)
    costs.c = 0.3
    gate = Gate(Speculation(tokens=4))
    for _ in range(10):
        gate.heard(1, 2, 0)  # drafts found by the last token alone: refused
        gate.heard(3, 4, 4)  # drafts found by the last three: kept
    assert gate.length(Draft([1, 2, 3, 4], 1), costs) == 0 and gate.length(Draft([1, 2, 3, 4], 3), costs) == 4


def sampled(p: SamplingParams, draft: list[int], logits: torch.Tensor, trials: int) -> list[list[int]]:
    decode = SpeculativeDecode.__new__(SpeculativeDecode)
    g = torch.Generator().manual_seed(0)
    r = SimpleNamespace(params=SimpleNamespace(sampling=p), generator=g)
    return [[t for t, _ in decode._accepted(r, draft, logits)] for _ in range(trials)]


def test_the_rejection_rule_samples_each_token_as_plain_sampling_would():
    """A draft token kept with probability p(d); otherwise a token from p without d: the first token is distributed
    as p, whatever the draft; with the draft kept, the next is drawn from its own position."""
    probs0 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    probs1 = torch.tensor([0.7, 0.1, 0.1, 0.1])
    logits = torch.stack([probs0.log(), probs1.log()])  # [2, V]: position 0 judges the draft, 1 the next
    runs = sampled(SamplingParams(4, temperature=1.0), [2], logits, 6000)
    first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=4).float() / len(runs)
    assert torch.allclose(first, probs0, atol=0.02)
    kept = [r for r in runs if r[0] == 2]
    assert all(len(r) == 2 for r in kept) and all(len(r) == 1 for r in runs if r[0] != 2)
    second = torch.bincount(torch.tensor([r[1] for r in kept]), minlength=4).float() / len(kept)
    assert torch.allclose(second, probs1, atol=0.04)
    top2 = sampled(SamplingParams(4, temperature=1.0, top_k=2), [0], logits, 2000)  # 0 is outside the top 2
    assert {r[0] for r in top2} == {2, 3}  # a draft the request's own sampling would never draw is never kept


def test_greedy_keeps_the_drafts_the_model_agrees_with_then_takes_its_own_token():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 1.0, 5.0], [5.0, 0.0, 1.0]])  # argmax 1, 2, 0
    greedy = SamplingParams(4)
    assert sampled(greedy, [1, 2], logits, 1) == [[1, 2, 0]]  # both kept, then the third position's
    assert sampled(greedy, [1, 0], logits, 1) == [[1, 2]]  # the second rejected: the model's own instead
    assert sampled(greedy, [2, 2], logits, 1) == [[1]]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3",
                                    "glm4_moe", "phimoe", "gpt_oss"])
def test_greedy_speculation_writes_what_plain_decoding_writes(tiny_store, family):
    _, path = tiny_store(family)
    g = torch.Generator().manual_seed(3)
    half = torch.randint(3, 128, (12,), generator=g).tolist()
    prompts = [half + half + half[:4], torch.randint(3, 128, (9,), generator=g).tolist()]  # a repeating one
    outputs = {}
    for spec in (None, Speculation(tokens=3)):
        with Engine.from_pretrained(path, expert_memory="50%", progress=False, speculation=spec) as engine:
            out = engine.generate(prompts, max_new_tokens=24, ignore_eos=True)
            outputs[spec is not None] = (out.token_ids, out.stats["speculation"])
            assert (engine.executor.residency.layers is not None) == (spec is not None)  # (auto: split under it)
    assert outputs[True][0] == outputs[False][0]
    assert outputs[True][1]["verify_steps"] > 0  # (drafts were verified: the path ran)


def test_the_cache_is_split_by_layer_where_speculation_verifies_drafts_under_a_budget():
    from moetier.engine.engine import EngineConfig
    from moetier.plan.precision import MixedPrecision

    spec = Speculation(tokens=4)
    auto = EngineConfig(speculation=spec)  # (cache_partition "auto", the default)
    assert auto.per_layer(slots=16, layers=4, experts=64)
    assert not auto.per_layer(slots=64, layers=4, experts=64)  # every expert held: nothing to thrash
    assert not auto.per_layer(slots=3, layers=4, experts=64)  # fewer slots than layers: one cache
    assert not EngineConfig().per_layer(slots=16, layers=4, experts=64)  # no speculation: one cache
    assert not EngineConfig(speculation=spec, cache_partition="global").per_layer(16, 4, 64)  # as asked
    assert EngineConfig(cache_partition="per-layer").per_layer(16, 4, 64)
    hobbit = MixedPrecision(mode="hobbit")  # (its cache is split by precision)
    assert not EngineConfig(speculation=spec, precision=hobbit).per_layer(16, 4, 64)
    with pytest.raises(MoetierError, match="split by layer"):
        EngineConfig(precision=hobbit, cache_partition="per-layer")


def test_generate_says_when_speculation_splits_the_cache(capsys):
    from pathlib import Path

    from moetier.cli import main

    model = Path(__file__).resolve().parents[2] / "models/demo-fine"  # (a model with a tokenizer: text prompts)
    base = ["generate", "--model", str(model), "--prompt", "a b a b a b", "--max-tokens", "4", "--speculate", "2"]
    assert main(base + ["--expert-memory", "50%"]) == 0
    assert "split among the" in capsys.readouterr().err
    assert main(base + ["--expert-memory", "50%", "--cache-partition", "global"]) == 0
    assert "split among the" not in capsys.readouterr().err
    assert main(base + ["--expert-memory", "100%"]) == 0  # every expert held: one cache
    assert "split among the" not in capsys.readouterr().err


def test_speculation_is_refused_for_an_encoder_decoder(tiny_store):
    _, path = tiny_store("switch_transformers")
    with pytest.raises(MoetierError, match="encoder-decoder"):
        Engine.from_pretrained(path, expert_memory="50%", progress=False, speculation=Speculation())
