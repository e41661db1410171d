"""Each prefetch stage in the simulator on GPU profiles with large models' shapes, against none.

Traces: synthetic, of each shape, with the skew and locality fitted to a recorded demo-model trace
(`moetier trace synth --fit`). They carry no hidden states, so the predictor is the oracle with an injected error
rate — by default the share of true experts stacked-gates misses one layer ahead on demo-deep's held-out text
(`moetier predict-bench`: 84% recall, so 16% wrong) — and the oracle without errors as the bound.

    python bench/sim_prefetch.py --fit bench/out/traces/demo-deep-held-out     # table + JSON + PNG in bench/out/
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from common import OUT, save_figure  # noqa: E402

PROFILES = ("rtx4090", "a100-pcie4")
SHAPES = ("mixtral-8x7b", "qwen3-30b-a3b")
STAGES = ("none", "hobbit", "smoe", "comoe", "presched", "ahead")


def main() -> None:
    from moetier.cli.models import model_shape
    from moetier.errors import BudgetError
    from moetier.progress import tqdm
    from moetier.sim.cost import CostModel
    from moetier.sim.predictors import trace_predictor
    from moetier.sim.profile import HardwareProfile
    from moetier.sim.sweep import budget_slots, run
    from moetier.trace.format import Trace
    from moetier.trace.synthetic import fit_locality, generate

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", required=True, help="a recorded trace whose skew and locality the traces copy")
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--budgets", default="10%,25%")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--error-rate", type=float, default=0.16, help="the oracle's injected error rate")
    ap.add_argument("--distance", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    fit = fit_locality(Trace.load(args.fit))
    profiles, shapes, budgets = args.profiles.split(","), args.shapes.split(","), args.budgets.split(",")
    stages = args.stages.split(",")
    predictors = [("oracle", args.error_rate), ("oracle", 0.0)]
    total = len(profiles) * len(shapes) * len(budgets) * (1 + (len(stages) - 1) * len(predictors))
    rows, bar = [], tqdm(total=total, desc="sim", unit="run")
    for shape_name in shapes:
        shape, _ = model_shape(shape_name)
        trace = generate(fit, num_layers=shape.num_layers, num_experts=shape.num_experts, top_k=shape.top_k,
                         layers=list(shape.moe_layers), model=shape.name, tokens=args.tokens, seed=0)
        for profile_name in profiles:
            cost = CostModel.of(HardwareProfile.load(profile_name), shape)
            for budget in budgets:
                try:
                    budget_slots(budget, trace, cost)
                except BudgetError as e:  # e.g. a quarter of Mixtral's experts is more than a 4090 holds
                    tqdm.write(f"skipped {shape_name} on {profile_name} at {budget}: {e}")
                    bar.update(1 + (len(stages) - 1) * len(predictors))
                    continue
                base = None
                for stage in stages:
                    for name, error in [("none", 0.0)] if stage == "none" else predictors:
                        make = None if stage == "none" else (
                            lambda t, e=error: trace_predictor("oracle", t, args.distance, error_rate=e))
                        r = run(trace, cost, "lru", budget, prefetch=stage, predictor=make)
                        s = r.result.summary()
                        base = s["tpot_s"] if stage == "none" else base
                        rows.append(dict(profile=profile_name, shape=shape_name, budget=budget, prefetch=stage,
                                         predictor=name if stage == "none" else f"oracle, {error:.0%} wrong",
                                         tpot_s=s["tpot_s"], ratio=s["tpot_s"] / base, hit_rate=s["hit_rate"],
                                         prefetches=s["prefetches"]))
                        bar.update()
    bar.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim-prefetch.json").write_text(json.dumps(dict(fit=args.fit, error_rate=args.error_rate,
                                                                 tokens=args.tokens, rows=rows), indent=1))
    plot(rows, args.out / "sim-prefetch.png")
    print(f"{'profile':>11} {'shape':>14} {'budget':>6} {'prefetch':>9} {'predictor':>18} {'TPOT ms':>9} "
          f"{'vs none':>8} {'hit':>6}")
    for r in rows:
        print(f"{r['profile']:>11} {r['shape']:>14} {r['budget']:>6} {r['prefetch']:>9} {r['predictor']:>18} "
              f"{r['tpot_s'] * 1e3:9.1f} {r['ratio'] - 1:+8.1%} {r['hit_rate']:6.1%}")
    print(f"wrote {args.out / 'sim-prefetch.json'} and {args.out / 'sim-prefetch.png'}")


def plot(rows: list[dict], path: Path) -> None:
    """TPOT relative to none per stage: a panel per (profile, shape), a bar group per budget and predictor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["profile"], r["shape"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4), squeeze=False)
    for ax, (profile, shape) in zip(axes[0], panels):
        mine = [r for r in rows if (r["profile"], r["shape"]) == (profile, shape) and r["prefetch"] != "none"]
        groups = list(dict.fromkeys((r["budget"], r["predictor"]) for r in mine))
        stages = list(dict.fromkeys(r["prefetch"] for r in mine))
        width = 0.8 / len(stages)
        for j, stage in enumerate(stages):
            vals = [next((r["ratio"] - 1) * 100 for r in mine if (r["budget"], r["predictor"]) == g
                         and r["prefetch"] == stage) for g in groups]
            ax.bar([i + (j - (len(stages) - 1) / 2) * width for i in range(len(groups))], vals, width, label=stage)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(groups)), [f"{b}\n{p}" for b, p in groups], fontsize=7)
        ax.set_title(f"{shape} on {profile}", fontsize=9)
    axes[0][0].set_ylabel("TPOT against no prefetch, %")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, "simulated prefetching (synthetic traces fitted to demo-deep's held-out routing)", path)


if __name__ == "__main__":
    main()
