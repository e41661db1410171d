"""Synthetic routing traces for model shapes that have no real trace, with skew and temporal locality fitted
to a real one. Skew: a Zipf exponent fitted to each layer's sorted expert popularity. Locality: the chance
that a routed slot keeps one of the previous token's experts, fitted so the synthetic trace reuses experts
from token to token as often as the real one."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from moetier.plan.route import DECODE, PREFILL
from moetier.trace.format import Trace
from moetier.trace.stats import popularity, reuse_next


@dataclass(frozen=True)
class LocalityFit:
    zipf_s: float  # popularity of the i-th most popular expert ~ i^-s
    p_keep: float  # chance a routed slot keeps an expert of the previous token
    reuse_next: float  # the share the fit reproduces
    source: str


def zipf_exponent(trace: Trace) -> float:
    exps = []
    for p in popularity(trace):
        p = np.sort(p[p > 0])[::-1]
        if len(p) > 2:
            exps.append(-np.polyfit(np.log(np.arange(1, len(p) + 1)), np.log(p), 1)[0])
    return float(np.mean(exps)) if exps else 0.0


def _popularity(num_experts: int, s: float, rng: np.random.Generator) -> np.ndarray:
    p = np.arange(1, num_experts + 1, dtype=float) ** -s
    return rng.permutation(p / p.sum())


def draw_without_replacement(rng: np.random.Generator, p: np.ndarray, size: int) -> list[int]:
    """`size` distinct indices drawn by the probabilities `p` (changed in place): what `rng.choice(len(p), size,
    replace=False, p=p)` returns, draw for draw — numpy's own steps (draw what is missing, drop repeats, zero the
    drawn, draw again), less its checks of `p` and its general-purpose unique, which made choice ~100 us a call
    and `moetier trace synth` of OLMoE's 16 layers × 4,000 tokens ~8 s (tests/trace/test_trace.py holds the two
    equal, so a trace seeded before is the same trace)."""
    if np.count_nonzero(p) < size:  # (numpy's refusal: otherwise an index past the end would be drawn)
        raise ValueError("fewer non-zero entries in p than size")
    found: list[int] = []
    while len(found) < size:
        x = rng.random(size - len(found))
        if found:
            p[found] = 0  # (an index drawn before has no width in the cdf: a new draw never repeats it)
        cdf = np.cumsum(p)
        cdf /= cdf[-1]
        for i in cdf.searchsorted(x, side="right").tolist():
            if i not in found:  # (the first of repeats, in the order drawn, as numpy keeps them)
                found.append(i)
    return found


def _stream(pop: np.ndarray, p_keep: float, top_k: int, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """One layer's routing of `tokens` consecutive tokens [T, k]: each slot keeps one of the previous token's
    experts with chance p_keep, the rest drawn by popularity."""
    ids = np.zeros((tokens, top_k), np.int16)
    prev: list[int] = []
    for t in range(tokens):
        keep = min(len(prev), int((rng.random(top_k) < p_keep).sum()))
        chosen = rng.choice(prev, keep, replace=False).tolist() if keep else []
        rest = pop.copy()
        rest[chosen] = 0
        chosen += draw_without_replacement(rng, rest / rest.sum(), top_k - keep)
        ids[t] = prev = chosen
    return ids


def generate(fit: LocalityFit, num_layers: int, num_experts: int, top_k: int, tokens: int,
             seed: int = 0, model: str = "synthetic", layers: list[int] | None = None) -> Trace:
    """`layers`: the model's MoE layers (default all of them)."""
    layers = list(range(num_layers)) if layers is None else list(layers)
    rng = np.random.default_rng(seed)
    ids = np.zeros((tokens, len(layers), top_k), np.int16)
    for layer in range(len(layers)):
        ids[:, layer] = _stream(_popularity(num_experts, fit.zipf_s, rng), fit.p_keep, top_k, tokens, rng)
    weights = np.full(ids.shape, 1.0 / top_k, np.float16)
    return Trace(model, num_layers, num_experts, top_k, layers, np.zeros(tokens, np.int32),
                 np.arange(tokens, dtype=np.int32), np.full(tokens, DECODE, np.uint8), ids, weights,
                 source=f"synthetic, fitted to {fit.source}", synthetic=True,
                 notes=[f"synthetic: {asdict(fit)}; weights are uniform (1/k); one stream of tokens"])


def generate_seq2seq(fit: LocalityFit, num_layers: int, num_experts: int, top_k: int, encoder_layers: int,
                     layers: list[int], sequences: int, prompt_tokens: int, new_tokens: int, seed: int = 0,
                     model: str = "synthetic") -> Trace:
    """An encoder-decoder's: `sequences` prompts of `prompt_tokens` each through the encoder's MoE layers (those of
    `layers` below `encoder_layers`), and `new_tokens` decoder tokens each (the start token's prefill, then decode
    steps) through the decoder's. Each layer keeps one popularity across the sequences (one model); locality runs
    within a prompt and within a generation."""
    rng = np.random.default_rng(seed)
    encoder = [layer for layer in layers if layer < encoder_layers]
    decoder = [layer for layer in layers if layer >= encoder_layers]
    pops = {layer: _popularity(num_experts, fit.zipf_s, rng) for layer in layers}

    def table(stack: list[int], tokens: int, phase: np.ndarray, note: str, encoder_trace: Trace | None = None) -> Trace:
        ids = np.stack([np.concatenate([_stream(pops[layer], fit.p_keep, top_k, tokens, rng)
                                        for _ in range(sequences)]) for layer in stack], axis=1).reshape(
            sequences * tokens, len(stack), top_k)
        return Trace(model, num_layers, num_experts, top_k, stack, np.repeat(np.arange(sequences, dtype=np.int32),
                                                                              tokens),
                     np.tile(np.arange(tokens, dtype=np.int32), sequences), np.tile(phase, sequences), ids,
                     np.full(ids.shape, 1.0 / top_k, np.float16), source=f"synthetic, fitted to {fit.source}",
                     synthetic=True, notes=[note], encoder=encoder_trace)

    enc = table(encoder, prompt_tokens, np.full(prompt_tokens, PREFILL, np.uint8),
                f"synthetic encoder: {sequences} prompts of {prompt_tokens} tokens") if encoder else None
    phases = np.array([PREFILL] + [DECODE] * (new_tokens - 1), np.uint8)
    return table(decoder, new_tokens, phases, f"synthetic encoder-decoder: {asdict(fit)}; weights are uniform "
                 f"(1/k); {sequences} sequences of {prompt_tokens} prompt and {new_tokens} new tokens", enc)


def fit_locality(trace: Trace, tokens: int = 1500, seed: int = 0) -> LocalityFit:
    """Fit the Zipf exponent, then p_keep by bisection so a synthetic trace of the same shape reuses experts
    at t+1 as often as `trace` does."""
    s = zipf_exponent(trace)
    target = float(np.nanmean(reuse_next(trace)))
    lo, hi = 0.0, 1.0
    for _ in range(10):
        mid = (lo + hi) / 2
        trial = LocalityFit(s, mid, target, trace.model)
        got = float(np.nanmean(reuse_next(generate(trial, 1, trace.num_experts, trace.top_k, tokens, seed))))
        lo, hi = (mid, hi) if got < target else (lo, mid)
    return LocalityFit(s, (lo + hi) / 2, target, trace.model)
