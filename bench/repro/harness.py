"""What the reproductions share: the traces (imported or drawn once into bench/out/traces), one simulated
configuration as a row, and the report — each claim of the paper beside ours, as JSON, a Markdown table and a plot.

A claim is a ratio both sides state the same way (a speed-up, a reduction, a gain in hit rate): `paper` is the
paper's figure, `ours` what the same comparison gives in the simulator, `agrees` whether the two point the same way
(both above 1, both below, or both within 1% of 1). Direction and rough magnitude are the bar (issue 32)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))
from common import OUT, save_figure  # noqa: E402

TRACES = OUT / "traces"
REAL_TRACES = ROOT / "data" / "traces"  # (shipped in the repository)
REAL = {"mixtral": "mixtral-8x7b", "qwen15": "qwen1.5-moe-a2.7b", "olmoe": "olmoe-1b-7b"}
HELD_OUT_PROMPTS = 24


def real_trace(name: str):
    """One of the shared real traces (`mixtral`, `qwen15`, `olmoe`), imported on first use."""
    from moetier.trace.format import Trace

    path = TRACES / name
    if not path.exists():
        subprocess.run(["moetier", "trace", "import", str(REAL_TRACES / REAL[name]), "--out", str(path)], check=True)
    return Trace.load(path)


def demo_trace(model: str = "demo-deep"):
    """`model`'s routing on held-out text, full router scores and gate inputs (recorded on first use, ~10 s)."""
    from moetier.trace.format import Trace

    path = TRACES / f"{model}-held-out"
    if not path.exists():
        from bench_predict import VALID_BOOKS, prompt_lines

        TRACES.mkdir(parents=True, exist_ok=True)
        prompts = TRACES / "held-out-prompts.txt"
        prompts.write_text("\n".join(prompt_lines(list(VALID_BOOKS), HELD_OUT_PROMPTS)) + "\n")
        subprocess.run(["moetier", "trace", "record", "--model", model, "--prompts", str(prompts), "--out",
                        str(path), "--max-tokens", "64", "--gate-inputs", "--expert-memory", "100%"], check=True)
    return Trace.load(path)


def synthetic(shape, fit_on, tokens: int, seed: int = 0):
    """A decode stream for `shape` with the skew and locality of the trace `fit_on` (moetier trace synth --fit)."""
    from moetier.trace.synthetic import fit_locality, generate

    return generate(fit_locality(fit_on), shape.num_layers, shape.num_experts, shape.top_k, tokens, seed=seed,
                    model=shape.name, layers=list(shape.moe_layers))


def shape_of(name: str, precision: str | None = None):
    from moetier.cli.models import model_shape

    shape, _ = model_shape(name)
    return dataclasses.replace(shape, precision=precision) if precision else shape


@dataclass(frozen=True)
class Config:
    """One simulated system: the policy and the planner's stages, as `moetier sim` takes them."""

    policy: str = "lru"
    prefetch: str = "none"
    predictor: str = "none"  # "oracle" (the trace's own routing), "score-oracle" (its full scores), "none"
    error: float = 0.0  # the oracle's share of wrong (token, expert) pairs
    distance: int = 1
    placement: str = "none"
    precision_mode: str = "native"
    low: str = ""
    substitute: bool = False
    preload: bool | str = False  # True: Engine.preload()'s order; "hot": a hot-expert table (the trace's most used
    # experts first, static-hot's counts), under whatever policy evicts
    policy_params: tuple = ()  # (key, value) pairs for the policy's constructor (a fitted table, weights)


def simulate(trace, shape, profile: str, budget: str, config: Config, batch: int | None = None) -> dict:
    """`trace` on `shape` and `profile` at `budget` under `config`: the replay's summary."""
    from moetier.cache.policies import PolicyContext
    from moetier.plan.precision import MixedPrecision
    from moetier.plan.substitute import Substitution
    from moetier.sim.cost import CostModel
    from moetier.sim.predictors import trace_predictor
    from moetier.sim.profile import HardwareProfile
    from moetier.sim.replay import simulate as replay
    from moetier.sim.replay import trace_policy
    from moetier.sim.sweep import budget_slots
    from moetier.trace.batch import interleave

    if batch is not None:
        trace = interleave(trace, batch)
    cost = CostModel.of(HardwareProfile.load(profile), shape, shape.precision)
    slots = budget_slots(budget, trace, cost)
    mixed = MixedPrecision(config.precision_mode, low=config.low)
    ctx = PolicyContext(slots, tuple(trace.all_layers), trace.num_experts, trace.top_k,
                        cost.precision if mixed.mixed else None)
    predictor = None
    if config.predictor == "score-oracle":
        from sim_smoe import score_oracle

        predictor = score_oracle(trace, config.error)
    elif config.predictor != "none":
        predictor = trace_predictor(config.predictor, trace, config.distance, error_rate=config.error)
    sub = Substitution().resolved(shape.total_expert_params) if config.substitute else None
    policy = trace_policy(config.policy, ctx, trace, **dict(config.policy_params))
    preload = hot_table(trace) if config.preload == "hot" else config.preload
    result = replay(trace, policy, slots, cost, cost.precision, preload, prefetch=config.prefetch,
                    predictor=predictor, mixed=mixed, substitution=sub, placement=config.placement)
    dec = result.counts.phases[1]
    return dict(profile=profile, shape=shape.name, budget=budget, slots=slots, interleaved=batch, **result.summary(),
                low_share=dec.low_runs / max(1, dec.needed))


def hot_table(trace) -> list:
    """The trace's experts, most used first (static-hot's counts; ties to the lower key): a hot-expert table."""
    from moetier.sim.fit import use_counts

    counts = use_counts(trace)
    return sorted(counts, key=lambda key: (-counts[key], key))


@dataclass(frozen=True)
class Claim:
    figure: str  # "Fig. 16", "Table 3"
    what: str  # the comparison, in words
    paper: float  # the paper's ratio
    ours: float  # ours, the same way round
    setting: str = ""  # our trace, shape, profile
    note: str = ""
    band: tuple[float, float] | None = None  # the paper's own range for this ratio, where it gives one
    why: str = ""  # where ours falls outside the band: why (geometry, trace, profile)

    def __post_init__(self) -> None:
        if self.paper <= 0 or self.ours <= 0:
            raise ValueError(f"{self.figure} {self.what}: ratios are positive, got {self.paper} and {self.ours}")
        if self.band is not None and not 0 < self.band[0] <= self.paper <= self.band[1]:
            raise ValueError(f"{self.figure} {self.what}: the band {self.band} must hold the paper's {self.paper}")

    @property
    def agrees(self) -> bool:
        def side(x: float) -> int:
            return 0 if abs(x - 1) <= 0.01 else (1 if x > 1 else -1)

        return side(self.paper) == side(self.ours)

    @property
    def bounds(self) -> tuple[float, float]:
        """The magnitude band: the paper's range where it states one, else within 2x of its ratio either way."""
        return self.band or (self.paper / 2, self.paper * 2)

    @property
    def in_band(self) -> bool:
        low, high = self.bounds
        return low <= self.ours <= high


def report(name: str, title: str, rows: list[dict], claims: list[Claim], out: Path = OUT / "repro") -> Path:
    """Write OUT/NAME.{json,md,png} (default bench/out/repro); print the table. Returns the JSON path."""
    from common import cpu_description

    out.mkdir(parents=True, exist_ok=True)
    table = ["| figure | comparison | setting | paper | ours | same direction | within the band |",
             "|---|---|---|---|---|---|---|"]
    for c in claims:
        low, high = c.bounds
        span = f"{low:.2f}–{high:.2f}×" if high != float("inf") else f"≥ {low:.2f}×"
        table.append(f"| {c.figure} | {c.what} | {c.setting} | {c.paper:.2f}× | {c.ours:.2f}× | "
                     f"{'yes' if c.agrees else '**no**'}{' — ' + c.note if c.note else ''} | "
                     f"{'yes' if c.in_band else '**no**'} ({span})"
                     f"{' — ' + c.why if c.why and not c.in_band else ''} |")
    (out / f"{name}.md").write_text("\n".join(table) + "\n")
    (out / f"{name}.json").write_text(json.dumps({
        "title": title, "cpu": cpu_description(),
        "claims": [dict(dataclasses.asdict(c), agrees=c.agrees, in_band=c.in_band, bounds=c.bounds) for c in claims],
        "rows": rows}, indent=1, default=str))
    plot(claims, out / f"{name}.png", title)
    print("\n".join(table))
    agree, in_band = sum(c.agrees for c in claims), sum(c.in_band for c in claims)
    print(f"{agree} of {len(claims)} claims point the same way, {in_band} of {len(claims)} within the magnitude band; "
          f"wrote {out / name}.json, .md and .png")
    return out / f"{name}.json"


def plot(claims: list[Claim], path: Path, title: str) -> None:
    """Paper and ours side by side per claim, as ratios (log scale; 1 = no change), the band between."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(claims) + 2), 4.2))
    x = np.arange(len(claims))
    ax.bar(x - 0.2, [c.paper for c in claims], 0.4, label="paper")
    ax.bar(x + 0.2, [c.ours for c in claims], 0.4, label="ours (simulated)")
    top = max(max(c.paper, c.ours) for c in claims) * 2  # (an open band is drawn to the plot's top)
    ax.vlines(x, [c.bounds[0] for c in claims], [min(c.bounds[1], top) for c in claims], color="grey", lw=3,
              alpha=0.5, label="magnitude band")
    ax.axhline(1, color="black", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(x, [f"{c.figure}\n{c.what}" for c in claims], fontsize=6, rotation=30, ha="right")
    ax.set_ylabel("ratio (speed-up, hit-rate gain, ...)")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    save_figure(fig, title, path)
