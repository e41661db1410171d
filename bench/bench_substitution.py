"""SMoE's substitution in the real engine: decode speed against exact mode, side by side in one run, with SMoE's
ablation steps (its Fig. 14) on top, each beside its quality cost from the harness.

Configurations (each in a fresh process, in rounds with a rotated order; the median TPOT is reported):
- exact          LRU, every routed expert computed (the baseline);
- sub            LRU + substitution at the model's default α (0.35 for models up to 20B expert parameters);
- sub:A          the same at α = A (--alphas);
- +CE            SMoE's score-window eviction, exact plans (Fig. 14's first step);
- +CR            +CE and the expert-cache router (substitution at the default α);
- +Pre           +CR and SMoE's prefetch of top-score experts from its look-ahead predictor (§IV-C).
(+BA, the CPU-assisted split of loads and CPU computes, needs a second compute device: it is measured in the
simulator, bench/sim_smoe.py.)

At batch 3 (--batches 1,3) three prompts decode together and a token's low-score expert may be replaced by another
token's top-score one (batch-aware). Quality: `moetier eval` at the same budget, policy and batch (perplexity
change, top-1 agreement, KL against exact), unless --no-quality.

    python bench/bench_substitution.py                    # demo-deep-xl at 25%; table, JSON + PNG in bench/out/
    python bench/bench_substitution.py --batches 1,3 --alphas 0.2,0.6
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
from common import add_run_options, median_row, rotated_rounds, save_figure  # noqa: E402

PROMPTS = ROOT / "prompts" / "mixed.txt"
STEPS = {  # name -> engine options (alpha None: the model's default)
    "exact": dict(policy="lru"),
    "sub": dict(policy="lru", alpha=None),
    "+CE": dict(policy="smoe-score"),
    "+CR": dict(policy="smoe-score", alpha=None),
    "+Pre": dict(policy="smoe-score", alpha=None, prefetch="smoe", predictor="smoe-lookahead"),
}


def options(config: str) -> dict:
    name, _, alpha = config.partition(":")
    opts = dict(STEPS[name])
    if alpha:
        opts["alpha"] = float(alpha)
    return opts


def child(cfg: dict) -> dict:
    """One configuration, in its own process: warm the cache on one prompt, measure on the rest of the text."""
    from moetier.config import MemoryBudget
    from moetier.engine.engine import Engine, EngineConfig
    from moetier.plan.substitute import Substitution
    from moetier.resolve import resolve_model
    from moetier.store.store import Store

    opts = options(cfg["config"])
    sub = Substitution(opts.pop("alpha")) if "alpha" in opts else None
    config = EngineConfig(expert_memory=MemoryBudget.parse(cfg["budget"]), substitution=sub, **opts)
    engine = Engine(Store(resolve_model(cfg["model"], progress=False)), config, progress=False)
    lines = [line for line in PROMPTS.read_text().splitlines() if line.strip()]
    tok, n, b = engine.tokenizer, cfg["prompt_len"], cfg["batch"]
    text = tok.encode(" ".join(lines[1:]))
    prompts = [text[i * n:(i + 1) * n] for i in range(b)]
    with engine:
        engine.generate([tok.encode(lines[0])] * b, max_new_tokens=cfg["warmup_tokens"], ignore_eos=True)
        stats = engine.generate(prompts, max_new_tokens=cfg["tokens"], ignore_eos=True).stats
    stats["alpha"] = engine.executor.substitution.alpha if engine.executor.substitution else None
    dec = stats["decode"]  # every decode (token, k) assignment of every MoE layer
    stats["substituted_share"] = dec["substituted"] / max(1, dec["layer_steps"] * b * engine.spec.top_k)
    return stats


def quality(model: str, budget: str, configs: list[str], batch: int, windows: int) -> dict[str, dict]:
    """`moetier eval` rows per configuration with a substitution (its own process, apart from the speed runs)."""
    out = {}
    for config in configs:
        opts = options(config)
        if "alpha" not in opts:
            continue
        alpha = "auto" if opts["alpha"] is None else str(opts["alpha"])
        cmd = ["moetier", "eval", "--model", model, "--expert-memory", budget, "--windows", str(windows),
               "--batch", str(batch), "--policy", opts["policy"], "--substitute", alpha, "--json"]
        if "prefetch" in opts:
            cmd += ["--prefetch", opts["prefetch"], "--predictor", opts["predictor"]]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            print(f"quality of {config} not measured: {run.stderr.strip()[-300:]}", file=sys.stderr)
            continue
        out[config] = json.loads(run.stdout)["rows"][1]
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(dict.fromkeys(r["batch"] for r in rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.2), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        mine = [r for r in rows if r["batch"] == batch]
        ax.bar([r["config"] for r in mine], [r["tpot_s"] * 1e3 for r in mine], color="tab:blue")
        for i, r in enumerate(mine):
            q = "" if r.get("perplexity_change") is None else f"\nppl {r['perplexity_change']:+.1%}"
            ax.annotate(f"{r['speedup']:.2f}x\nhit {r['hit_rate']:.0%}{q}", (i, r["tpot_s"] * 1e3), ha="center",
                        fontsize=7, xytext=(0, 3), textcoords="offset points")
        ax.set(title=f"{mine[0]['model']} at {mine[0]['budget']}, batch {batch}", ylabel="ms per decode step")
        ax.margins(y=0.25)
    save_figure(fig, "moetier: SMoE substitution and its ablation steps (median TPOT; speed-up, hit rate, ppl)",
                path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(ap)
    ap.set_defaults(budgets="25%")
    ap.add_argument("--model", default="demo-deep-xl")
    ap.add_argument("--configs", default=",".join(STEPS), help=f"of {', '.join(STEPS)}; exact is the baseline")
    ap.add_argument("--alphas", default="", help="extra substitution-only rows at these α (sub:A)")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quality", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--quality-windows", type=int, default=3, help="windows per text for `moetier eval`")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from moetier.progress import tqdm

    configs = args.configs.split(",") + [f"sub:{a}" for a in args.alphas.split(",") if a]
    if "exact" not in configs:
        configs.insert(0, "exact")
    for c in configs:
        options(c)  # refuses an unknown name before anything runs
    budgets, batches = args.budgets.split(","), [int(b) for b in args.batches.split(",")]
    bar = tqdm(total=len(budgets) * len(batches) * len(configs) * args.rounds, desc="bench", unit="run")
    rows = []
    for budget in budgets:
        for batch in batches:
            runs = rotated_rounds(__file__, configs, args.rounds,
                                  dict(model=args.model, budget=budget, tokens=args.tokens, batch=batch,
                                       warmup_tokens=args.warmup_tokens, prompt_len=args.prompt_len), bar)
            qual = quality(args.model, budget, configs, batch, args.quality_windows) if args.quality else {}
            base = statistics.median(s["tpot_s"] for s in runs["exact"])
            for config, stats in runs.items():
                rows.append(dict(model=Path(args.model).name, budget=budget, batch=batch, config=config,
                                 alpha=stats[0]["alpha"],
                                 **median_row(stats, base, qual.get(config, {}), medians=("substituted_share",))))
    bar.close()
    args.out.mkdir(parents=True, exist_ok=True)
    report = dict(rounds=args.rounds, tokens=args.tokens, warmup_tokens=args.warmup_tokens,
                  prompt_len=args.prompt_len, quality_windows=args.quality_windows, rows=rows)
    (args.out / "substitution.json").write_text(json.dumps(report, indent=1))
    plot(rows, args.out / "substitution.png")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print(f"{'budget':>6} {'batch':>5} {'config':>10} {'alpha':>5} {'TPOT ms':>8} {'speed-up':>8} {'hit':>6} "
          f"{'MiB/tok':>8} {'subst':>6} {'d ppl':>7} {'top-1':>6} {'KL':>7}")
    for r in rows:
        print(f"{r['budget']:>6} {r['batch']:>5} {r['config']:>10} {fmt(r['alpha'], '5.2f'):>5} "
              f"{r['tpot_s'] * 1e3:8.1f} {r['speedup']:7.2f}x {r['hit_rate']:6.1%} "
              f"{r['expert_bytes_per_token'] / 2**20:8.2f} {r['substituted_share']:6.1%} "
              f"{fmt(r['perplexity_change'], '+7.1%'):>7} {fmt(r['top1_agreement'], '6.1%'):>6} "
              f"{fmt(r['kl'], '7.4f'):>7}")
    print(f"wrote {args.out / 'substitution.json'} and {args.out / 'substitution.png'}")


if __name__ == "__main__":
    main()
