"""The sampler, on hand-made logits, against a reference written from each option's definition (transformers',
llama.cpp's, OpenAI's): what each keeps and with what probability, how the draw picks, that a batch mixing settings
samples each row as it would alone, and what it refuses."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.engine.sampling import SamplingParams, draw, filtered, sample, shape_logits
from moetier.errors import MoetierError

V = 12


def reference(logits: np.ndarray, p: SamplingParams, context: list[int], output: list[int]) -> np.ndarray:
    """One row's final distribution [V], from the definitions, in float64."""
    x = logits.astype(np.float64).copy()
    for t, b in p.logit_bias:
        x[t] += b
    if p.repetition_penalty != 1 and p.repetition_window != 0:
        window = context if p.repetition_window < 0 else context[-p.repetition_window:]
        for t in set(window):  # transformers' RepetitionPenaltyLogitsProcessor, llama.cpp's repeat_penalty
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):  # OpenAI: mu[j] -= c[j] * frequency_penalty + float(c[j] > 0) * presence_penalty
        c = output.count(t)
        x[t] -= c * p.frequency_penalty + p.presence_penalty
    if p.temperature == 0:
        out = np.zeros(V)
        out[int(np.argmax(x))] = 1
        return out
    probs = np.exp((x - x.max()) / p.temperature)
    probs /= probs.sum()
    order = sorted(range(V), key=lambda t: (-probs[t], t))
    keep = set(order[:p.top_k] if p.top_k else order)
    mass = 0.0
    for rank, t in enumerate(order):
        if rank > 0 and mass >= p.top_p:
            keep.discard(t)
        mass += probs[t]
    keep = {t for t in keep if probs[t] >= p.min_p * probs[order[0]]}
    out = np.array([probs[t] if t in keep else 0.0 for t in range(V)])
    return out / out.sum()


def ours(logits: torch.Tensor, params: list[SamplingParams], contexts, outputs) -> np.ndarray:
    """Our final distribution for each row, dense [B, V]."""
    x = shape_logits(logits, params, contexts, outputs)
    out = np.zeros((len(params), V))
    for i, p in enumerate(params):
        if p.greedy:
            out[i, int(x[i].argmax())] = 1
            continue
        probs, ids = filtered(x[i:i + 1], [p])
        out[i, ids[0].numpy()] = probs[0].double().numpy()
    return out


LOGITS = torch.tensor([[2.0, 1.5, 1.4, 0.3, -0.5, -1.0, 3.0, 0.0, -2.0, 0.9, 1.1, -0.2]])
CONTEXT, OUTPUT = [6, 0, 3, 6, 9, 4, 6], [6, 4, 6]
CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "top_p": SamplingParams(temperature=1.0, top_p=0.6),
    "min_p": SamplingParams(temperature=1.0, min_p=0.2),
    "repetition": SamplingParams(temperature=1.0, repetition_penalty=1.8),
    "repetition_window": SamplingParams(temperature=1.0, repetition_penalty=1.8, repetition_window=3),
    "repetition_all": SamplingParams(temperature=1.0, repetition_penalty=1.3, repetition_window=-1),
    "presence": SamplingParams(temperature=1.0, presence_penalty=1.5),
    "frequency": SamplingParams(temperature=1.0, frequency_penalty=0.8),
    "logit_bias": SamplingParams(temperature=1.0, logit_bias=((3, 5.0), (6, -100.0))),
    "greedy_penalised": SamplingParams(temperature=0.0, presence_penalty=2.0),
    "everything": SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                                 presence_penalty=0.5, frequency_penalty=0.3, logit_bias=((2, 1.0),)),
}


@pytest.mark.parametrize("name", CASES)
def test_each_option_keeps_what_its_definition_keeps(name):
    p = CASES[name]
    want = reference(LOGITS[0].numpy(), p, CONTEXT, OUTPUT)
    got = ours(LOGITS, [p], [CONTEXT], [OUTPUT])[0]
    assert np.allclose(got, want, atol=1e-6), f"{name}: {got.round(4)} vs {want.round(4)}"


def test_the_options_change_something():
    """(The reference must not agree by doing nothing.)"""
    plain = reference(LOGITS[0].numpy(), CASES["temperature"], CONTEXT, OUTPUT)
    for name in ("top_k", "top_p", "min_p", "repetition", "presence", "frequency", "logit_bias"):
        assert not np.allclose(reference(LOGITS[0].numpy(), CASES[name], CONTEXT, OUTPUT), plain), name
    assert reference(LOGITS[0].numpy(), CASES["greedy_penalised"], CONTEXT, OUTPUT).argmax() != 6  # 6 repeated


def test_the_draw_is_the_inverse_cdf():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    ids = torch.tensor([[9, 4, 7, 1]])
    for u, token in ((0.0, 9), (0.49, 9), (0.5, 4), (0.79, 4), (0.8, 7), (0.9999, 7)):
        assert draw(probs, ids, torch.tensor([u])).item() == token, u


def test_draws_follow_the_distribution():
    p = CASES["everything"]
    g = torch.Generator().manual_seed(0)
    counts = np.zeros(V)
    for _ in range(4000):
        counts[sample(LOGITS, [p], [g], [CONTEXT], [OUTPUT])[0]] += 1
    want = reference(LOGITS[0].numpy(), p, CONTEXT, OUTPUT)
    assert counts[want == 0].sum() == 0
    assert np.abs(counts / 4000 - want).max() < 0.03


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(sorted(CASES)), min_size=2, max_size=6), st.integers(0, 2**31))
def test_a_batch_mixing_settings_samples_each_row_as_alone(names, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(names), V, generator=g) * 2
    params = [CASES[n] for n in names]
    contexts = [torch.randint(0, V, (7,), generator=g).tolist() for _ in names]
    outputs = [c[-3:] for c in contexts]
    gens = [SamplingParams(seed=seed + i).generator() for i in range(len(names))]
    together = sample(logits, params, gens, contexts, outputs)
    alone = [sample(logits[i:i + 1], [p], [SamplingParams(seed=seed + i).generator()], [contexts[i]], [outputs[i]])[0]
             for i, p in enumerate(params)]
    assert together == alone


def test_plain_greedy_is_the_models_argmax_and_draws_nothing():
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert sample(logits, [SamplingParams()] * 3, [g] * 3) == logits.float().argmax(-1).tolist()
    assert torch.equal(g.get_state(), state)


def test_unseeded_requests_differ_and_seeded_ones_repeat():
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0, seed=None)
    assert len({sample(logits, [p], [p.generator()])[0] for _ in range(8)}) > 1
    q = SamplingParams(temperature=1.0, seed=7)
    assert len({sample(logits, [q], [q.generator()])[0] for _ in range(8)}) == 1


@pytest.mark.parametrize("field,value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -0.1), ("top_p", 0.0), ("top_p", math.nan),
    ("min_p", 1.5), ("repetition_penalty", 0.0), ("repetition_penalty", math.inf), ("presence_penalty", 2.5),
    ("frequency_penalty", -math.inf), ("top_k", -1), ("top_k", 2.5), ("seed", 2**64), ("seed", -1),
    ("repetition_window", -2), ("max_new_tokens", 2.5), ("max_new_tokens", 0), ("logit_bias", ((1, 101.0),)),
    ("logit_bias", ((1, math.nan),)), ("logit_bias", ((-1, 1.0),)),
])
def test_what_is_refused_names_the_option(field, value):
    with pytest.raises(MoetierError, match=field.split("_")[0]):
        SamplingParams(**{field: value})
