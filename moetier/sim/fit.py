"""Fitting the policies that learn from a trace: HOBBIT's weights, FlashMoE's networks, static-hot's profile.

Everything here reads a trace; what it makes is saved with a model (`<model>/policies/<name>.json`) by
`moetier train cache-policy`, or handed straight to a policy (`cache-bench` trains on the first part of each
trace and evaluates on the rest)."""

from __future__ import annotations

import itertools

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.flashmoe_ml import FEATURES, CacheModel, LayerMLP, features
from moetier.cache.policies.hobbit import HobbitPolicy, HobbitWeights
from moetier.plan.precision import MixedPrecision
from moetier.sim.predictors import trace_counts
from moetier.sim.replay import NATIVE, replay, steps
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
    """Tokens each expert processed (PreScope's Counter): static-hot's profile."""
    return {ExpertKey(layer, e): int(n) for layer, counts in trace_counts(trace).items()
            for e, n in enumerate(counts) if n}


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


def train_flashmoe(trace: Trace, hidden: int = 128, depth: int = 3, max_epochs: int = 200, patience: int = 5,
                   batch_size: int = 2048, max_samples: int = 40_000, seed: int = 0, progress: bool = False
                   ) -> CacheModel:
    """One network per layer as FlashMoE's Table 1 states it: `depth` hidden layers of `hidden` with SiLU, MSE,
    AdamW (lr 1e-3, weight decay 1e-2), up to `max_epochs` epochs of minibatches, stopped early when the error on
    a held-back tenth of the samples has not improved by 0.1% for `patience` epochs (the best epoch's weights
    kept)."""
    import torch

    from moetier.progress import tqdm

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    used = use_matrix(trace)
    layers = {}
    for j, layer in enumerate(tqdm(trace.layers, desc="flashmoe-ml", unit="layer", disable=not progress)):
        x, y = belady_samples(used[:, j], max_samples, rng)
        order = rng.permutation(len(x))
        held = order[:max(1, len(x) // 10)]
        fit = order[len(held):] if len(x) > len(held) else held
        x_t, y_t = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
        sizes = [len(FEATURES), *[hidden] * depth, 1]
        blocks = []
        for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
            blocks += [torch.nn.Linear(a, b)] + ([torch.nn.SiLU()] if i < depth else [])
        net = torch.nn.Sequential(*blocks)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-2)
        best, best_state, stale = float("inf"), None, 0
        for _ in range(max_epochs):
            for batch in torch.from_numpy(rng.permutation(fit)).split(batch_size):
                opt.zero_grad()
                torch.nn.functional.mse_loss(net(x_t[batch]).squeeze(1), y_t[batch]).backward()
                opt.step()
            with torch.no_grad():
                held_loss = float(torch.nn.functional.mse_loss(net(x_t[held]).squeeze(1), y_t[held]))
            if held_loss < best * (1 - 1e-3):  # an improvement of at least 0.1% resets the patience
                best, best_state, stale = held_loss, {k: v.clone() for k, v in net.state_dict().items()}, 0
            else:
                stale += 1
                if stale >= patience:
                    break
        net.load_state_dict(best_state)
        linears = [m for m in net if isinstance(m, torch.nn.Linear)]
        layers[layer] = LayerMLP(tuple(m.weight.detach().numpy().T.copy() for m in linears),
                                 tuple(m.bias.detach().numpy().copy() for m in linears))
    return CacheModel(layers, trained_on=f"{trace.model} ({trace.num_tokens} token steps; {trace.source})")


def weight_grid(step: float = 0.25) -> list[HobbitWeights]:
    n = round(1 / step)
    return [HobbitWeights(*(c * step for c in combo)) for combo in itertools.product(range(n + 1), repeat=4)
            if sum(combo) == n]


# HOBBIT §3.4's miss penalty: a miss costs its copy's bit width over the high copy's (a 16-bit miss C, int4 C/4)
PENALTY_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, NATIVE: 16, "int8": 8, "int4": 4, "int2": 2, "q8_0": 8, "q6_k": 6,
                "q5_k": 5, "q4_k": 4}


def miss_penalty(plans, high: str) -> float:
    """Σ over the loads of `plans` of their copy's bits over the high copy's, in units of one high-precision miss."""
    return sum(PENALTY_BITS[ld.precision] for p in plans for ld in p.loads) / PENALTY_BITS[high]


def fit_hobbit(trace: Trace, num_slots: int, step: float = 0.25, mixed: MixedPrecision | None = None,
               high: str = NATIVE, entry_bytes: dict[str, int] | None = None) -> tuple[HobbitWeights, list[tuple]]:
    """HOBBIT's weights: the grid point of least miss penalty (Fig. 18a's measure) replaying `trace` with `num_slots`
    slots (of the model's own precision `high`) in the precision mode `mixed` — default one precision, where the
    penalty is the miss count; `hobbit`: the run's own pair (mixed.pair(high): int8 + int2 as well as 16-bit + int4),
    a missed low copy costing B_l/B_h of a missed high one (1/4 for both) and LHU counting uses at the pair's high
    precision. `entry_bytes`: one expert's bytes at each precision of the pair as the run's store lays them out, so
    the replayed sub-caches hold as many entries as the run's (default: their bit widths, which split the bytes
    alike but for scales and alignment). `mixed`'s thresholds: give the model's fitted ones (the paper's otherwise).
    Returns the weights and the grid, each point with its penalty."""
    mixed = mixed or MixedPrecision()
    if mixed.mixed:
        mixed = mixed.with_thresholds()
    pair = mixed.pair(high) if mixed.mixed else (high,)
    entry_bytes = entry_bytes or {p: PENALTY_BITS[p] for p in {high, *pair}}
    ctx = PolicyContext(num_slots, tuple(trace.layers), trace.num_experts, trace.top_k,
                        pair[0] if mixed.mixed else None)
    table = []
    for w in weight_grid(step):
        result = replay(trace, HobbitPolicy(ctx, w), num_slots, precision=high, keep_plans=True, mixed=mixed,
                        entry_bytes=entry_bytes if mixed.mixed else None)
        table.append((w, miss_penalty(result.plans, pair[0])))
    # ties go to the simpler policy; at one precision LHU counts what per-sequence LFU counts
    best = min(table, key=lambda t: (t[1], -t[0].lru, -t[0].lfu))
    return best[0], table
