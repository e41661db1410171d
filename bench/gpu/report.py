"""The GPU benchmark's rows (bench_gpu.py's JSON, one file per model) as a markdown table and a plot: decode TPOT per
GPU expert budget, each mode at its budget, the disk rows and accelerate's beside them.

    python bench/gpu/report.py bench/gpu/results/2026-11-27-h200 --plot docs/img/gpu-h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows_of(folder: Path) -> tuple[str, list[dict]]:
    device, rows = "", []
    for path in sorted(folder.glob("bench-*.json")):
        data = json.loads(path.read_text())
        device = data.get("device", device)
        rows += [r for r in data["rows"] if "tpot_s" in r]
    return device, rows


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
        cells = [r["model"], label(r), tier, r["budget"], str(r["batch"]), f"{r['tpot_s'] * 1e3:.1f}",
                 f"{r['decode_tokens_per_s']:.2f}", "-" if hit is None else f"{hit:.0%}",
                 "-" if mb is None else f"{mb / 1e6:.0f}",
                 f"{pf.get('used', 0)} / {pf.get('issued', 0)}" if pf else "-",
                 "-" if r.get("host_runs") is None else str(r["host_runs"])]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(rows: list[dict], device: str, path: Path) -> None:
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
        ax.plot(xs, [r["tpot_s"] * 1e3 for r in lru], "o-", color="C0", label="moetier lru, host tier")
        others = [r for r in mine if r not in lru]
        for i, r in enumerate(others):
            x = float(r["budget"].rstrip("%"))
            ax.scatter([x], [r["tpot_s"] * 1e3], marker="sxD^v<>p*hX"[i % 11], s=50, color=f"C{i + 1}", label=label(r),
                       zorder=3)
        ax.set_yscale("log")
        ax.set_xlabel("GPU expert budget (% of the experts)")
        ax.set_ylabel("decode TPOT, ms (log)")
        ax.set_title(f"{model}, batch 1")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"Decode on {device}: experts behind a GPU cache (one run, 2026-11-27)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    device, rows = rows_of(args.folder)
    print(table(rows))
    if args.plot:
        plot(rows, device, args.plot)


if __name__ == "__main__":
    main()
