"""Decode at each precision mode against exact mode, side by side in one run, on models whose experts have a real
size, each beside its quality cost from the harness.

Models: demo-deep-xl (demo-deep's experts inflated to OLMoE's 12 MiB: real routing, real reads) and, with
--synth, olmoe-1b-7b-synth (OLMoE-1B-7B's shape with random weights; see bench_offload.py). Each configuration
(`native` = exact mode, `hobbit`, `low-tier`, or any --precision value; MODE:LOW[:HIGH] names the low copy and the
high one, e.g. hobbit:int2:int8 for HOBBIT's int8+int2 pair) runs in a fresh process, in rounds with a rotated order
so a drift of the disk spreads over all of them; reported: the median TPOT, the speed-up over native, hit rate,
expert bytes read per token and the share of experts computed at low precision. Quality: `moetier eval` on the same
model and budget (perplexity change, top-1 agreement, KL against exact), unless --no-quality.

    python bench/bench_precision.py                         # demo-deep-xl at 25%; table, JSON + PNG in bench/out/
    python bench/bench_precision.py --synth --rounds 2
    python bench/bench_precision.py --frontier              # every mode and pair, demo-deep-xl and demo-fine-xl at
                                                            # 10/25/50%: speed against quality (frontier.png)
    python bench/bench_precision.py --report A/precision.json B/precision.json --out DIR   # one frontier of several

A mode the budget cannot hold (low-tier where even int2 copies of every expert do not fit) is a row saying so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from common import add_run_options, median_row, model_panels, rotated_rounds, save_panels  # noqa: E402

CONFIGS = ("native", "hobbit", "low-tier")
# every mode, and HOBBIT's and low-tier's pairs: bf16+int4 (the default), int8+int2 (HOBBIT's other), int8+int4
FRONTIER = ("native", "int8", "int4", "int2", "hobbit", "hobbit:int2:int8", "hobbit:int4:int8", "low-tier",
            "low-tier:int2:int8", "low-tier:int4:int8")
PROMPTS = ROOT / "prompts" / "mixed.txt"


def child(cfg: dict) -> dict:
    """One configuration, in its own process: warm the cache on one prompt, measure on the rest of the text."""
    from moetier.config import MemoryBudget
    from moetier.engine.engine import Engine, EngineConfig
    from moetier.errors import MoetierError
    from moetier.plan.precision import MixedPrecision
    from moetier.resolve import resolve_model
    from moetier.store.store import Store

    mode, low, high = parse_config(cfg["config"])
    config = EngineConfig(expert_memory=MemoryBudget.parse(cfg["budget"]), policy=cfg["policy"],
                          precision=MixedPrecision(mode, low=low, high=high))
    try:
        engine = Engine(Store(resolve_model(cfg["model"], progress=False)), config, progress=False)
    except MoetierError as e:  # this mode does not run at this budget: a row that says so, not a failed sweep
        return dict(refused=str(e).splitlines()[0])
    lines = [line for line in PROMPTS.read_text().splitlines() if line.strip()]
    tok = engine.tokenizer
    warm = tok.encode(lines[0]) if tok else list(range(3, 3 + cfg["prompt_len"]))
    prompt = (tok.encode(" ".join(lines[1:])) if tok else list(range(40, 400)))[:cfg["prompt_len"]]
    with engine:
        engine.generate([warm], max_new_tokens=cfg["warmup_tokens"], ignore_eos=True)
        stats = engine.generate([prompt], max_new_tokens=cfg["tokens"], ignore_eos=True).stats
    dec = stats["decode"]
    stats["low_share"] = dec["low_runs"] / max(1, dec["needed"])
    return stats


def parse_config(config: str) -> tuple[str, str, str]:
    """MODE[:LOW[:HIGH]] -> (mode, low copy, high copy) ("" for a mode's default)."""
    mode, low, high = (config.split(":") + ["", ""])[:3]
    return mode, low, high


def quality(model: str, budget: str, configs: list[str], windows: int) -> dict[str, dict]:
    """`moetier eval` rows for the configurations (its own process: the engine's speed is measured apart): one
    sweep over the plain modes, one run for each MODE:LOW:HIGH."""
    plain = [c for c in configs if c != "native" and ":" not in c]
    runs = [(None, ["--sweep", "precision=" + ",".join(plain)])] if plain else []
    for c in configs:
        if ":" in c:
            mode, low, high = parse_config(c)
            runs.append((c, ["--precision", mode] + (["--low-precision", low] if low else [])
                         + (["--high-precision", high] if high else [])))
    found = {}
    for config, extra in runs:
        out = subprocess.run(["moetier", "eval", "--model", model, "--expert-memory", budget, "--windows",
                              str(windows), *extra, "--json"], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"quality of {model} {extra} not measured: {out.stderr.strip()[-300:]}", file=sys.stderr)
            continue
        rows = json.loads(out.stdout)["rows"]
        if config is None:
            found.update({r["label"].removeprefix("precision="): r for r in rows[1:]})
        else:
            found[config] = rows[-1]
    return found


def plot_frontier(rows: list[dict], path: Path) -> None:
    """Speed-up over exact against perplexity change, one panel per model, a marker per budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5), squeeze=False)
    markers = dict(zip(dict.fromkeys(r["budget"] for r in rows), "os^Dv"))
    for ax, model in zip(axes[0], models):
        for r in (r for r in rows if r["model"] == model and r.get("perplexity_change") is not None
                  or (r["model"] == model and r["config"] == "native")):
            change = 0.0 if r["config"] == "native" else r["perplexity_change"]
            ax.scatter(change, r["speedup"], marker=markers[r["budget"]], color=f"C{list(markers).index(r['budget'])}")
            ax.annotate(r["config"], (change, r["speedup"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
        for budget, m in markers.items():
            ax.scatter([], [], marker=m, color=f"C{list(markers).index(budget)}", label=f"budget {budget}")
        ax.axvline(0.01, color="grey", lw=0.8, ls=":")
        ax.set(title=model, xlabel="perplexity change vs exact", ylabel="decode speed-up vs exact (x)")
        ax.xaxis.set_major_formatter(PercentFormatter(1.0))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("every precision mode and pair: speed against quality (dotted: +1% perplexity)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(rows: list[dict], path: Path) -> None:
    fig, panels = model_panels(rows, 5.5, 4)
    for ax, model, mine in panels:
        ax.bar([r["config"] for r in mine], [r["tpot_s"] * 1e3 for r in mine], label="median TPOT")
        for i, r in enumerate(mine):
            q = "" if r.get("perplexity_change") is None else f"\nppl {r['perplexity_change']:+.1%}"
            ax.annotate(f"{r['speedup']:.2f}x{q}", (i, r["tpot_s"] * 1e3), ha="center", fontsize=7,
                        xytext=(0, 3), textcoords="offset points")
        ax.set_title(f"{model} at {mine[0]['budget']}")
    save_panels(fig, "moetier decode by precision mode (median TPOT; speed-up and perplexity change)", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(ap)
    ap.set_defaults(budgets="25%")
    ap.add_argument("--models", default="demo-deep-xl")
    ap.add_argument("--synth", action="store_true", help="also the OLMoE-shaped synthetic model (13 GB, made once)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="precision modes (native is the baseline)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quality", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--quality-windows", type=int, default=3, help="windows per text for `moetier eval`")
    ap.add_argument("--frontier", action="store_true",
                    help="every mode and pair on demo-deep-xl and demo-fine-xl at 10/25/50%% (frontier.png)")
    ap.add_argument("--report", nargs="+", type=Path, metavar="JSON",
                    help="only draw the frontier of earlier runs' precision.json files (one model or budget each)")
    args = ap.parse_args()
    if args.report:
        rows = [r for path in args.report for r in json.loads(path.read_text())["rows"]]
        args.out.mkdir(parents=True, exist_ok=True)
        plot_frontier([r for r in rows if "refused" not in r], args.out / "frontier.png")
        (args.out / "frontier.json").write_text(json.dumps(dict(sources=[str(p) for p in args.report], rows=rows),
                                                           indent=1))
        print(f"wrote {args.out / 'frontier.png'} and {args.out / 'frontier.json'}")
        return
    if args.frontier:
        args.models, args.budgets, args.configs = "demo-deep-xl,demo-fine-xl", "10%,25%,50%", ",".join(FRONTIER)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from moetier.progress import tqdm

    models = args.models.split(",")
    if args.synth:
        from bench_offload import SYNTH, store_of

        store = store_of(SYNTH)  # written once (13 GB), then its int4/int2 copies added once
        subprocess.run(["moetier", "quantize", str(store), "--precisions", "int4,int2"], check=True)
        models.append(str(store))
    budgets, configs = args.budgets.split(","), args.configs.split(",")
    if "native" not in configs:
        configs.insert(0, "native")
    bar = tqdm(total=len(models) * len(budgets) * len(configs) * args.rounds, desc="bench", unit="run")
    rows = []
    for model in models:
        for budget in budgets:
            runs = rotated_rounds(__file__, configs, args.rounds,
                                  dict(model=model, budget=budget, policy=args.policy, tokens=args.tokens,
                                       warmup_tokens=args.warmup_tokens, prompt_len=args.prompt_len), bar)
            refused = {c: s["refused"] for c, stats in runs.items() for s in stats if "refused" in s}
            ran = [c for c in configs if c not in refused]
            qual = quality(model, budget, ran, args.quality_windows) if args.quality and "synth" not in model \
                else {}
            base = statistics.median(s["tpot_s"] for s in runs["native"])
            for config, stats in runs.items():
                row = dict(model=Path(model).name, budget=budget, config=config)
                rows.append(dict(row, refused=refused[config]) if config in refused else
                            dict(row, **median_row(stats, base, qual.get(config, {}), medians=("low_share",))))
    bar.close()
    args.out.mkdir(parents=True, exist_ok=True)
    report = dict(policy=args.policy, rounds=args.rounds, tokens=args.tokens, warmup_tokens=args.warmup_tokens,
                  prompt_len=args.prompt_len, quality_windows=args.quality_windows, rows=rows)
    (args.out / "precision.json").write_text(json.dumps(report, indent=1))
    measured = [r for r in rows if "refused" not in r]
    plot(measured, args.out / "precision.png")
    if args.frontier:
        plot_frontier(measured, args.out / "frontier.png")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print(f"{'model':>18} {'budget':>6} {'config':>14} {'TPOT ms':>8} {'speed-up':>8} {'hit':>6} {'MiB/tok':>8} "
          f"{'low':>5} {'d ppl':>7} {'top-1':>6} {'KL':>7}")
    for r in rows:
        if "refused" in r:
            print(f"{r['model']:>18} {r['budget']:>6} {r['config']:>14} does not run: {r['refused']}")
            continue
        print(f"{r['model']:>18} {r['budget']:>6} {r['config']:>14} {r['tpot_s'] * 1e3:8.1f} {r['speedup']:7.2f}x "
              f"{r['hit_rate']:6.1%} {r['expert_bytes_per_token'] / 2**20:8.2f} {r['low_share']:5.0%} "
              f"{fmt(r['perplexity_change'], '+7.1%'):>7} {fmt(r['top1_agreement'], '6.1%'):>6} "
              f"{fmt(r['kl'], '7.4f'):>7}")
    print(f"wrote {args.out / 'precision.json'} and {args.out / 'precision.png'}")


if __name__ == "__main__":
    main()
