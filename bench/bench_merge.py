"""CoMoE's merged variants measured: quality against size (the analogue of the paper's Fig. 3) and decode speed at one
expert budget.

Quality (default): for each model and each α, `moetier merge --library --alpha α` builds the paper's six variants
and scores each against the original on the held-out prose and code (perplexity, top-1 agreement, KL); one table,
JSON and a plot of perplexity change against expert bytes. The issue's target — some variant at ≤ 50% of the expert
bytes within +5% perplexity of the original, on every model — is checked and printed.

Speed (`--speed`): a merged variant against its original at the same expert budget in bytes (a share of the
original's experts), each run a fresh `moetier eval` process decoding the same held-out text token by token
(teacher-forced: both models are fed the same tokens, so their routing is that of real text — a greedy `generate`
of a degraded model falls into a loop, "-in-in-in-…", whose repeated routing hits the cache every time and
flatters it), the two alternating and the order turning every round; decode tokens/s and expert bytes read per
token per run, and their ratio per round.

    python bench/bench_merge.py                                   # demo-deep and demo-fine, α = 0, 0.5, 1
    moetier merge --model demo-deep-xl --ratio 0.5 --out ~/.cache/moetier/bench/deep-xl-fixed-medium
    python bench/bench_merge.py --speed ~/.cache/moetier/bench/deep-xl-fixed-medium --original demo-deep-xl
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import OUT, cpu_description, model_panels  # noqa: E402

BYTES_TARGET, PPL_TARGET = 0.5, 0.05


def quality(models: list[str], alphas: list[float], out: Path, refit: str = "down") -> list[dict]:
    """`refit`: how each merged expert is fitted to its group's outputs (`moetier merge --refit`)."""
    rows = []
    for model in models:
        for alpha in alphas:
            folder = out / f"{model}-alpha-{alpha:g}-refit-{refit}"
            subprocess.run([sys.executable, "-m", "moetier.cli", "merge", "--model", model, "--library", "--alpha",
                            str(alpha), "--out", str(folder), "--force", "--refit", refit], check=True)
            library = json.loads((folder / "library.json").read_text())
            original = library["variants"][0]["expert_bytes"]
            for v in library["variants"]:
                if v["name"] == "original" and alpha != alphas[0]:
                    continue  # (the same model every time)
                rows.append({"model": model, "alpha": None if v["name"] == "original" else alpha, "name": v["name"],
                             "bytes_share": v["expert_bytes"] / original, "kept": v["kept"], **v["quality"]})
    return rows


def quality_table(rows: list[dict]) -> str:
    domains = list(rows[0]["perplexity"])
    lines = ["| model | variant | α | expert bytes | " + " | ".join(f"ppl {d}" for d in domains)
             + " | Δ ppl | top-1 | KL |", "|---" * (7 + len(domains)) + "|"]
    for r in rows:
        alpha = "—" if r["alpha"] is None else f"{r['alpha']:g}"
        lines.append(f"| {r['model']} | {r['name']} | {alpha} | {r['bytes_share']:.0%} | "
                     + " | ".join(f"{r['perplexity'][d]:.2f}" for d in domains)
                     + f" | {r['perplexity_change']:+.1%} | {r['top1_agreement']:.1%} | {r['kl']:.4f} |")
    return "\n".join(lines)


def verdict(rows: list[dict]) -> str:
    """The target on every model: the best variant at ≤ 50% of the bytes, and whether it is within +5%."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        small = [r for r in rows if r["model"] == model and r["alpha"] is not None
                 and r["bytes_share"] <= BYTES_TARGET + 1e-9]
        best = min(small, key=lambda r: r["perplexity_change"])
        met = "met" if best["perplexity_change"] <= PPL_TARGET else "not met"
        out.append(f"{model}: best at <= {BYTES_TARGET:.0%} of the bytes is {best['name']} (α {best['alpha']:g}, "
                   f"{best['bytes_share']:.0%}): {best['perplexity_change']:+.1%} perplexity — target +5% {met}")
    return "\n".join(out)


def plot_quality(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, panels = model_panels(rows, 5.5, 4.2)
    markers = {0.0: "v", 0.5: "o", 1.0: "^"}
    for ax, model, mine in panels:
        for r in mine:
            color = "black" if r["alpha"] is None else ("tab:blue" if r["name"].startswith("fixed") else "tab:orange")
            ax.scatter([r["bytes_share"]], [100 * r["perplexity_change"]], color=color,
                       marker=markers.get(r["alpha"], "s"), s=28)
        ax.axvline(BYTES_TARGET, color="grey", lw=0.6, ls=":")
        ax.axhline(100 * PPL_TARGET, color="grey", lw=0.6, ls=":")
        ax.set_yscale("symlog", linthresh=10)
        ax.set_xlabel("expert bytes (share of the original's)")
        ax.set_ylabel("perplexity change (%)")
        ax.set_title(f"{model}: blue fixed, orange adaptive; ▼ α=0 ● 0.5 ▲ 1", fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def teacher_forced(model: str, budget: str, window: int, windows: int, policy: str = "lru") -> dict:
    """Decode tokens/s and expert bytes per token of one fresh `moetier eval` (exact mode's row: the model as it is)
    over `windows` windows of `window` tokens of each held-out text."""
    r = subprocess.run([sys.executable, "-m", "moetier.cli", "eval", "--model", model, "--expert-memory", budget,
                        "--window", str(window), "--windows", str(windows), "--policy", policy, "--json"],
                       capture_output=True, text=True, check=True)
    row = json.loads(r.stdout)["rows"][0]
    return {"tok_s": row["decode_tokens_per_s"], "bytes_per_token": row["expert_bytes_per_token"],
            "hit_rate": row["hit_rate"]}


def speed(merged: str, original: str, share: float, rounds: int, window: int, windows: int,
          policy: str = "lru") -> list[dict]:
    from moetier.resolve import resolve_model
    from moetier.store.store import Store

    budget = f"{int(share * Store(resolve_model(original)).total_expert_bytes())}B"  # the same bytes for both
    rows = []
    for i in range(rounds):
        order = [("original", original), ("merged", merged)]
        for label, model in order if i % 2 == 0 else order[::-1]:
            rows.append({"round": i, "model": label, **teacher_forced(model, budget, window, windows, policy)})
            print(f"round {i} {label}: {rows[-1]['tok_s']:.2f} tok/s, {rows[-1]['bytes_per_token'] / 2**20:.0f} "
                  f"MiB/token, hits {rows[-1]['hit_rate']:.1%}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="demo-deep,demo-fine")
    ap.add_argument("--alphas", default="0,0.5,1")
    ap.add_argument("--speed", metavar="MERGED", help="time this merged store against --original instead")
    ap.add_argument("--original", default="demo-deep-xl")
    ap.add_argument("--share", type=float, default=0.25, help="--speed: the budget, a share of the original's "
                                                                "expert bytes")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--policy", default="lru", help="--speed: both runs' eviction policy")
    ap.add_argument("--window", type=int, default=64, help="--speed: tokens per window of held-out text")
    ap.add_argument("--windows", type=int, default=2, help="--speed: windows per text")
    ap.add_argument("--refit", choices=["none", "down", "all"], default="down",
                    help="quality: `moetier merge --refit` (docs/merging.md)")
    ap.add_argument("--out", type=Path, default=OUT / "merge")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": cpu_description()}
    if args.speed:
        rows = speed(args.speed, args.original, args.share, args.rounds, args.window, args.windows, args.policy)
        ratios = [m["tok_s"] / o["tok_s"] for o, m in zip(rows[0::2], rows[1::2])]
        ratios = [r if rows[2 * i]["model"] == "original" else 1 / r for i, r in enumerate(ratios)]
        print(f"merged / original, per round: {', '.join(f'{r:.2f}' for r in ratios)}; median "
              f"{statistics.median(ratios):.2f}")
        (args.out / "merge_speed.json").write_text(json.dumps(
            {**meta, "merged": args.speed, "original": args.original, "share": args.share, "policy": args.policy,
             "runs": rows,
             "ratios": ratios}, indent=1))
        return
    rows = quality(args.models.split(","), [float(a) for a in args.alphas.split(",")], args.out, args.refit)
    table = quality_table(rows)
    print(table)
    print(verdict(rows))
    name = f"merge_quality_refit_{args.refit}"
    (args.out / f"{name}.json").write_text(json.dumps({**meta, "refit": args.refit, "rows": rows}, indent=1))
    (args.out / f"{name}.md").write_text(table + "\n\n" + verdict(rows) + "\n")
    plot_quality(rows, args.out / f"{name}.png")


if __name__ == "__main__":
    main()
