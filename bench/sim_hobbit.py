"""HOBBIT's dynamic-loading ablation (its Fig. 16) in the simulator: Mixtral-8x7B's real routing (the shared
trace) on the rtx4090 profile with fp16 experts (+ int4 copies) and on jetson-orin with int8 experts (+ int2
copies), as the paper pairs them; each budget run at the high precision alone (`native`), with HOBBIT's loader
(`hobbit`: T1 = 0.6, T2 = 0.9, high sub-cache 75% of the bytes), and with our `low-tier` where the low copies fit.
Decode TPOT, the speed-up over `native`, and the share of experts computed at low precision; the paper reports
1.19-1.57x for dynamic loading.

    moetier trace import data/traces/mixtral-8x7b --out bench/out/traces/mixtral   # once
    python bench/sim_hobbit.py --trace bench/out/traces/mixtral      # table + JSON + PNG in bench/out/
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from common import OUT, save_figure  # noqa: E402

SETUPS = {"rtx4090": ("fp16", "int4"), "jetson-orin": ("int8", "int2")}  # the paper's Table 2 pairs
MODES = ("native", "hobbit", "low-tier")


def main() -> None:
    from moetier.cache.policies import PolicyContext
    from moetier.cli.models import model_shape
    from moetier.errors import BudgetError
    from moetier.plan.precision import MixedPrecision
    from moetier.progress import tqdm
    from moetier.sim.cost import CostModel
    from moetier.sim.profile import HardwareProfile
    from moetier.sim.replay import simulate, trace_policy
    from moetier.sim.sweep import budget_slots
    from moetier.trace.format import Trace

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="Mixtral-8x7B's routing (moetier trace import)")
    ap.add_argument("--profiles", default=",".join(SETUPS))
    ap.add_argument("--budgets", default="10%,20%,auto", help="shares of the experts, or auto (the fast tier's room)")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    trace = Trace.load(args.trace)
    shape, _ = model_shape("mixtral-8x7b")
    profiles, budgets = args.profiles.split(","), args.budgets.split(",")
    rows = []
    with tqdm(total=len(profiles) * len(budgets) * len(MODES), desc="sim", unit="run") as bar:
        for name in profiles:
            high, low = SETUPS[name]
            cost = CostModel.of(HardwareProfile.load(name), dataclasses.replace(shape, precision=high), high)
            for budget in budgets:
                slots = budget_slots(budget, trace, cost)
                for mode in MODES:
                    bar.update()
                    ctx = PolicyContext(slots, tuple(trace.layers), trace.num_experts, trace.top_k,
                                        high if mode != "native" else None)
                    mixed = MixedPrecision(mode, low=low if mode != "native" else "")
                    try:
                        result = simulate(trace, trace_policy(args.policy, ctx, trace), slots, cost, high,
                                          mixed=mixed)
                    except BudgetError as e:  # low-tier whose low copies do not fit beside a layer's top-k
                        rows.append({"profile": name, "budget": budget, "mode": mode, "skipped": str(e)})
                        continue
                    dec = result.counts.phases[1]
                    rows.append({"profile": name, "pair": f"{high}+{low}", "budget": budget, "slots": slots,
                                 "mode": mode, **result.summary(), "low_share": dec.low_runs / max(1, dec.needed),
                                 "skipped_pairs": dec.skipped, "low_loads": dec.low_loads, "loads": dec.loads})
    for r in rows:
        base = next(b for b in rows if (b["profile"], b["budget"], b["mode"]) == (r["profile"], r["budget"], "native"))
        if "tpot_s" in r and base.get("tpot_s"):
            r["speedup"] = base["tpot_s"] / r["tpot_s"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_hobbit.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                          "rows": rows}, indent=1, default=str))
    print(f"{'profile':>12} {'pair':>10} {'budget':>6} {'mode':>9} {'TPOT ms':>8} {'speed-up':>8} {'hit':>6} "
          f"{'low':>5} {'MiB/tok':>8}")
    for r in rows:
        if "tpot_s" not in r:
            print(f"{r['profile']:>12} {'':>10} {r['budget']:>6} {r['mode']:>9}  does not fit")
            continue
        print(f"{r['profile']:>12} {r['pair']:>10} {r['budget']:>6} {r['mode']:>9} {r['tpot_s'] * 1e3:8.1f} "
              f"{r['speedup']:7.2f}x {r['hit_rate']:6.1%} {r['low_share']:5.0%} "
              f"{r['expert_bytes_per_token'] / 2**20:8.1f}")
    plot(rows, args.out / "sim_hobbit.png")
    print(f"json: {args.out / 'sim_hobbit.json'}; plot: {args.out / 'sim_hobbit.png'}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    fig, axes = plt.subplots(1, len(profiles), figsize=(5 * len(profiles), 4), squeeze=False)
    for ax, name in zip(axes[0], profiles):
        for mode in MODES:
            mine = [r for r in rows if r["profile"] == name and r["mode"] == mode and "speedup" in r]
            ax.plot([r["budget"] for r in mine], [r["speedup"] for r in mine], marker="o", label=mode)
        ax.axhspan(1.19, 1.57, color="grey", alpha=0.2, label="HOBBIT Fig. 16: 1.19-1.57x")
        ax.set(title=f"Mixtral-8x7B on {name}", xlabel="expert budget", ylabel="decode speed-up over native")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, "dynamic expert loading, simulated (HOBBIT Fig. 16)", path)


if __name__ == "__main__":
    main()
