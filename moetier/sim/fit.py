"""Fitting the policies that learn from a trace: HOBBIT's weights, FlashMoE's networks, static-hot's profile.

Everything here reads a trace; what it makes is saved with a model (`<model>/policies/<name>.json`) by
`moetier train cache-policy`, or handed straight to a policy (`cache-bench` trains on the first part of each
trace and evaluates on the rest)."""

from __future__ import annotations

import itertools

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.flashmoe_ml import CacheModel, LayerMLP, features
from moetier.cache.policies.hobbit import HobbitPolicy, HobbitWeights
from moetier.sim.replay import replay, steps
from moetier.trace.format import Trace


def use_matrix(trace: Trace) -> np.ndarray:
    """[S, L, E] bool: which experts each layer used at each forward step (the replay's steps)."""
    groups = [rows for _, rows in steps(trace)]
    used = np.zeros((len(groups), len(trace.layers), trace.num_experts), bool)
    for s, rows in enumerate(groups):
        for j in range(len(trace.layers)):
            used[s, j, np.unique(trace.topk_ids[rows, j])] = True
    return used


def use_counts(trace: Trace) -> dict[ExpertKey, int]:
    """Layer steps in which each expert was used: static-hot's profile."""
    counts = use_matrix(trace).sum(axis=0)  # [L, E]
    return {ExpertKey(layer, e): int(counts[j, e]) for j, layer in enumerate(trace.layers)
            for e in range(trace.num_experts) if counts[j, e]}


def belady_samples(used: np.ndarray, max_samples: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """For one layer's [S, E] uses: FlashMoE's features of every expert seen so far at every step, and the
    target log(1 + steps to its next use) (Belady's knowledge; never again: past the end of the trace)."""
    num_steps, num_experts = used.shape
    steps = np.arange(1, num_steps + 1, dtype=float)  # replay steps count from 1
    next_use = np.full(num_experts, np.inf)
    nxt = np.empty((num_steps, num_experts))
    for s in range(num_steps - 1, -1, -1):  # next use at or after step s
        next_use = np.where(used[s], steps[s], next_use)
        nxt[s] = next_use
    count = np.vstack([np.zeros(num_experts), np.cumsum(used, axis=0)[:-1]])  # uses before step s
    last = np.zeros(num_experts)
    xs, ys = [], []
    for s in range(num_steps):
        seen = count[s] > 0
        if seen.any():
            x = features(int(steps[s]), last[seen], count[s][seen], float(count[s].max()))
            horizon = np.where(np.isinf(nxt[s][seen]), 2 * num_steps, nxt[s][seen] - steps[s])
            xs.append(x)
            ys.append(np.log1p(horizon))
        last = np.where(used[s], steps[s], last)
    x, y = np.concatenate(xs), np.concatenate(ys)
    if len(x) > max_samples:
        pick = rng.choice(len(x), max_samples, replace=False)
        x, y = x[pick], y[pick]
    return x, y


def train_flashmoe(trace: Trace, hidden: int = 16, iterations: int = 400, max_samples: int = 40_000,
                   seed: int = 0) -> CacheModel:
    """One network per layer, fitted by mean squared error with Adam on the layer's Belady targets."""
    import torch

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    used = use_matrix(trace)
    layers = {}
    for j, layer in enumerate(trace.layers):
        x, y = belady_samples(used[:, j], max_samples, rng)
        x_t, y_t = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
        net = torch.nn.Sequential(torch.nn.Linear(2, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        for _ in range(iterations):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x_t).squeeze(1), y_t)
            loss.backward()
            opt.step()
        w1, b1, w2, b2 = (p.detach().double().numpy() for p in net.parameters())
        layers[layer] = LayerMLP(w1.T.copy(), b1, w2[0], float(b2[0]))
    return CacheModel(layers, trained_on=f"{trace.model} ({trace.num_tokens} token steps; {trace.source})")


def weight_grid(step: float = 0.25) -> list[HobbitWeights]:
    n = round(1 / step)
    return [HobbitWeights(*(c * step for c in combo)) for combo in itertools.product(range(n + 1), repeat=4)
            if sum(combo) == n]


def fit_hobbit(trace: Trace, num_slots: int, step: float = 0.25) -> tuple[HobbitWeights, list[tuple]]:
    """HOBBIT's weights: the grid point of least miss penalty replaying `trace` with `num_slots` slots. Every
    miss loads one full-precision expert until mixed precision lands, so penalty is proportional to misses."""
    ctx = PolicyContext(num_slots, tuple(trace.layers), trace.num_experts, trace.top_k)
    table = []
    for w in weight_grid(step):
        result = replay(trace, HobbitPolicy(ctx, w), num_slots)
        table.append((w, result.needed - result.hits))
    # ties go to the simpler policy; at one precision LHU counts what per-sequence LFU counts
    best = min(table, key=lambda t: (t[1], -t[0].lru, -t[0].lfu))
    return best[0], table

