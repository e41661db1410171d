"""`moetier doctor`: what a model will do on a machine before anyone downloads it — from its shape alone (a config.json
or a shipped shape) and a hardware profile.

It says whether the model fits resident, the least expert budget that runs at all (one layer's top-k experts beside
the dense weights), and the simulated decode time and memory at a few budgets for the modes a user would try: exact,
HOBBIT's mixed precision, the int4 low tier and SMoE's substitution. The routing is a decode stream drawn for the
shape with the skew and locality of real routing (Qwen1.5-MoE-A2.7B's shared trace, fitted once: `LOCALITY`), so
the numbers rank budgets and modes; the real model's own routing can differ."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from moetier.cache.policies import DEFAULT_POLICY, PolicyContext
from moetier.config import format_bytes
from moetier.errors import BudgetError, MoetierError
from moetier.plan.precision import MixedPrecision
from moetier.plan.substitute import Substitution
from moetier.sim.cost import CostModel
from moetier.sim.profile import HardwareProfile
from moetier.sim.replay import simulate, trace_policy
from moetier.sim.shapes import ModelShape, bytes_per_param
from moetier.sim.sweep import budget_slots
from moetier.trace.synthetic import LocalityFit, generate

# fit_locality on data/traces/qwen1.5-moe-a2.7b (the five layers, warm-up dropped), 2026-11-26
LOCALITY = LocalityFit(zipf_s=0.1845, p_keep=0.0522, reuse_next=0.1173,
                       source="Qwen1.5-MoE-A2.7B's real routing (GSM8K), fitted")
GATE_CONCENTRATION = 1.5  # Dirichlet: top-k shares near Mixtral's real 0.71/0.29 and Qwen1.5's 0.42/0.26/0.18/0.15
TOP_K_MASS = 0.8  # of a token's router probability, on its top-k (the rest spread below the k-th)
RUNTIME_BYTES = 384 << 20  # what the engine's runtime takes beside the weights (moetier/engine/budget.py)
BUDGETS = ("10%", "25%", "50%", "100%", "auto")
MODES = {  # name -> (precision mode, substitute)
    "exact": (MixedPrecision(), False),
    "hobbit": (MixedPrecision("hobbit", low="int4"), False),
    "low-tier": (MixedPrecision("low-tier", low="int4"), False),
    "substitution": (MixedPrecision(), True),
}


@dataclass(frozen=True)
class Cell:
    mode: str
    budget: str
    cache_bytes: int
    memory_bytes: int  # dense weights + the cache + the runtime
    tpot_s: float | None  # None: the budget does not fit the profile, or the mode cannot run at it
    hit_rate: float | None
    why: str = ""


def diagnose(shape: ModelShape, profile: HardwareProfile, tokens: int = 200, seed: int = 0,
             locality: LocalityFit = LOCALITY) -> dict:
    """The plan: what fits, the least budget, and a cell per (mode, budget). `locality`: the skew and locality to
    draw the routing with (default: Qwen1.5-MoE's; a recorded trace of the model itself says more)."""
    cost = CostModel.of(profile, shape, shape.precision)
    expert = cost.expert_bytes
    experts = len(shape.moe_layers) * shape.num_experts * expert
    dense = shape.dense_bytes(shape.precision)
    trace = with_gates(generate(locality, shape.num_layers, shape.num_experts, shape.top_k, tokens, seed=seed,
                                model=shape.name, layers=list(shape.moe_layers)), np.random.default_rng(seed))
    cells = [_cell(trace, cost, mode, budget, dense) for mode in MODES for budget in BUDGETS]
    least = shape.top_k * expert
    return {
        "model": shape.name, "profile": profile.name, "precision": cost.precision,
        "dense_bytes": dense, "expert_bytes": experts, "expert_each_bytes": expert,
        "fast_tier_bytes": profile.fast_tier_bytes,
        "fits_resident": dense + experts + RUNTIME_BYTES <= profile.fast_tier_bytes,
        "least_budget_bytes": least, "least_memory_bytes": dense + least + RUNTIME_BYTES,
        "runs_at_all": dense + least + RUNTIME_BYTES <= profile.fast_tier_bytes,
        "routing": locality.source, "tokens": tokens,
        "cells": [dataclasses.asdict(c) for c in cells],
        "notes": [n for n in (small_reads_note(profile, expert),) if n],
    }


SMALL_READS = 8  # experts this many times larger than those the disk was timed on: its figures do not carry over


def small_reads_note(profile: HardwareProfile, expert_bytes: int) -> str | None:
    """A calibrated profile's disk was timed on its model's own blobs (`measured[0]`: the model calibration last
    ran on), and a small read pays a whole request for few bytes: demo-fine's 192 KiB experts queue at ~0.65 GB/s
    on a disk that reads 12 MiB ones at 3.7 (a Zen 5's). Calibration splits the two with larger spans of the same
    file (`per_read_s`) where the file holds them; where it could not (a disk timed at one small size), a model whose
    experts are far larger is priced its reads several times slow: say so, and how to time the disk for them."""
    disk = profile.tiers[0]
    if not profile.measured or disk.per_read_s > 0:
        return None
    m = profile.measured[0]
    timed = 3 * m.hidden_size * m.moe_intermediate_size * bytes_per_param(m.precision)  # (a SwiGLU expert)
    if expert_bytes < SMALL_READS * timed:
        return None
    return (f"{profile.name}'s disk was timed on experts of ~{format_bytes(int(timed))}; this model's of "
            f"{format_bytes(expert_bytes)} read faster than that, so where reads dominate the TPOT here is high. "
            f"`moetier calibrate --model M` with experts near this size (demo-deep-xl, built on first use) times "
            f"the disk as they read")


def with_gates(trace, rng: np.random.Generator):
    """A drawn trace's uniform 1/k weights replaced by gates as routers give them: the top-k shares from a Dirichlet,
    sorted, holding TOP_K_MASS of the token's probability, and full router scores with the rest spread over the other
    experts, each below the k-th — what HOBBIT's loader and SMoE's substitution decide from."""
    n, layers, k = trace.topk_ids.shape
    e = trace.num_experts
    top = -np.sort(-rng.dirichlet([GATE_CONCENTRATION] * k, (n, layers)), axis=-1) * TOP_K_MASS  # [N, L, k]
    rest = rng.dirichlet([1.0] * max(1, e - k), (n, layers)) * (1 - TOP_K_MASS)  # [N, L, E-k]
    rest = np.minimum(rest, 0.9 * top[..., -1:])
    scores = np.zeros((n, layers, e), np.float32)
    others = np.argsort(rng.random((n, layers, e)), axis=-1)  # [N, L, E] the experts in a random order
    chosen = np.zeros((n, layers, e), bool)
    np.put_along_axis(chosen, trace.topk_ids.astype(np.int64), True, axis=-1)
    order = np.argsort(np.take_along_axis(chosen, others, axis=-1), axis=-1, kind="stable")  # the unchosen first
    unchosen = np.take_along_axis(others, order, axis=-1)[..., :e - k]
    np.put_along_axis(scores, unchosen, rest[..., :e - k].astype(np.float32), axis=-1)
    np.put_along_axis(scores, trace.topk_ids.astype(np.int64), top.astype(np.float32), axis=-1)
    return dataclasses.replace(trace, topk_weights=top.astype(np.float16), scores=scores.astype(np.float16))


def _cell(trace, cost: CostModel, mode: str, budget: str, dense: int) -> Cell:
    mixed, substitute = MODES[mode]
    try:
        slots = budget_slots(budget, trace, cost)
    except MoetierError as e:  # more than the fast tier holds beside the dense weights
        share = float(budget[:-1]) / 100
        cache = int(share * len(trace.layers) * trace.num_experts * cost.expert_bytes)
        return Cell(mode, budget, cache, dense + cache + RUNTIME_BYTES, None, None, str(e).split(":")[0])
    cache = slots * cost.expert_bytes
    ctx = PolicyContext(slots, tuple(trace.layers), trace.num_experts, trace.top_k,
                        cost.precision if mixed.mixed else None)
    sub = Substitution().resolved(cost.shape.total_expert_params) if substitute else None
    try:
        result = simulate(trace, trace_policy(DEFAULT_POLICY, ctx, trace), slots, cost, cost.precision, mixed=mixed,
                          substitution=sub)
    except BudgetError as e:  # the low tier's copies and a layer's top-k do not fit the budget
        return Cell(mode, budget, cache, dense + cache + RUNTIME_BYTES, None, None, str(e).split(":")[0])
    s = result.summary()
    return Cell(mode, budget, cache, dense + cache + RUNTIME_BYTES, s["tpot_s"], s["hit_rate"])


def format_plan(plan: dict) -> str:
    lines = [f"{plan['model']} on {plan['profile']} ({plan['precision']} experts)",
             f"  dense weights {format_bytes(plan['dense_bytes'])}, experts {format_bytes(plan['expert_bytes'])} "
             f"({format_bytes(plan['expert_each_bytes'])} each); fast tier {format_bytes(plan['fast_tier_bytes'])}",
             f"  resident (every expert in memory): {'fits' if plan['fits_resident'] else 'does not fit'}",
             f"  least that runs: {format_bytes(plan['least_budget_bytes'])} of experts, "
             f"{format_bytes(plan['least_memory_bytes'])} in all"
             + ("" if plan["runs_at_all"] else " — more than this machine has"),
             *(f"  note: {n}" for n in plan.get("notes", [])),
             f"  simulated decode on a drawn trace ({plan['routing']}, {plan['tokens']} tokens):",
             f"  {'mode':>13} {'budget':>7} {'memory':>10} {'TPOT ms':>9} {'tok/s':>7} {'hit':>6}"]
    for c in plan["cells"]:
        if c["tpot_s"] is None:
            lines.append(f"  {c['mode']:>13} {c['budget']:>7} {format_bytes(c['memory_bytes']):>10}  "
                         f"does not fit: {c['why']}")
            continue
        lines.append(f"  {c['mode']:>13} {c['budget']:>7} {format_bytes(c['memory_bytes']):>10} "
                     f"{c['tpot_s'] * 1e3:9.1f} {1 / c['tpot_s']:7.1f} {c['hit_rate']:6.1%}")
    return "\n".join(lines)


def plot_plan(plan: dict, path) -> None:
    """TPOT against memory, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in MODES:
        mine = [c for c in plan["cells"] if c["mode"] == mode and c["tpot_s"] is not None]
        ax.plot([c["memory_bytes"] / 2**30 for c in mine], [c["tpot_s"] * 1e3 for c in mine], marker="o", label=mode)
    ax.axvline(plan["fast_tier_bytes"] / 2**30, color="grey", ls="--", lw=0.8, label="fast tier")
    ax.set(xlabel="memory, GiB (dense + expert cache + runtime)", ylabel="TPOT, ms (simulated)",
           title=f"{plan['model']} on {plan['profile']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
