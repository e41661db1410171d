"""The GPU benchmark's rows (bench_gpu.py's JSON, one file per model) as a markdown table and a plot: decode TPOT per
GPU expert budget, each mode at its budget, the disk rows and accelerate's beside them. Each configuration's rounds
are folded into one row (runs.py): the median TPOT, the rounds' range beside it in the table and as a bar in the plot.

    python bench/gpu/report.py bench/gpu/results/2026-11-27-h200 --plot docs/img/gpu-h200.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runs import fold, load, rounds, spread  # noqa: E402


def label(r: dict) -> str:
    if r["engine"] != "moetier":
        return f"{r['engine']} {r['mode']} {r['budget']}"
    return r["mode"] + ("" if r.get("tier") in (None, "host") else f" ({r['tier']})")


def table(rows: list[dict]) -> str:
    out = ["| model | engine / mode | tier | GPU budget | batch | TPOT ms | decode tok/s | hit rate | expert MB/token "
           "| prefetches used / issued | CPU runs |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pf, hit, mb = r.get("prefetches") or {}, r.get("decode_hit_rate"), r.get("expert_bytes_per_token")
        tier = r.get("tier", "-") if r["engine"] == "moetier" else f"host ({r['engine'].split()[0]}'s)"
        cells = [r["model"], label(r), tier, r["budget"], str(r["batch"]), spread(r),
                 f"{r['decode_tokens_per_s']:.2f}", "-" if hit is None else f"{hit:.0%}",
                 "-" if mb is None else f"{mb / 1e6:.0f}",
                 f"{pf['used']} / {pf['issued']}" if pf.get("issued") else "-",
                 "-" if r.get("host_runs") is None else str(r["host_runs"])]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def errors(rows: list[dict]) -> list[list[float]]:
    """matplotlib's yerr (ms below, ms above each median) from the rounds' range."""
    return [[(r["tpot_s"] - rounds(r)[0]) * 1e3 for r in rows], [(rounds(r)[-1] - r["tpot_s"]) * 1e3 for r in rows]]


def plot(rows: list[dict], device: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model and r["batch"] == 1]
        lru = sorted((r for r in mine if r["engine"] == "moetier" and r["mode"] == "lru" and r.get("tier") == "host"),
                     key=lambda r: float(r["budget"].rstrip("%")))
        xs = [float(r["budget"].rstrip("%")) for r in lru]
        ax.errorbar(xs, [r["tpot_s"] * 1e3 for r in lru], yerr=errors(lru), fmt="o-", color="C0", capsize=3,
                    label="moetier lru, host tier")
        others = [r for r in mine if r not in lru]
        for i, r in enumerate(others):
            x = float(r["budget"].rstrip("%"))
            ax.errorbar([x], [r["tpot_s"] * 1e3], yerr=errors([r]), fmt="sxD^v<>p*hX"[i % 11], markersize=7,
                        color=f"C{(i + 1) % 10}", capsize=3, label=label(r), zorder=3)
        ax.set_yscale("log")
        ax.set_xlabel("GPU expert budget (% of the experts)")
        ax.set_ylabel("decode TPOT, ms (log)")
        ax.set_title(f"{model}, batch 1")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"Decode on {device}: experts behind a GPU cache ({title})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    device, measured = load(args.folder)
    rows = fold(measured)
    print(table(rows))
    if args.plot:
        n = max(len(rounds(r)) for r in rows)
        plot(rows, device, args.plot, f"{args.folder.name}, " + ("one round" if n == 1 else f"medians of {n} rounds"))


if __name__ == "__main__":
    main()
