"""What the benchmarks share: the measurement options, and one configuration per fresh process (so each
one's peak RSS and caches are its own)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def add_run_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--budgets", default="100%,50%,25%")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--tokens", type=int, default=32, help="measured tokens")
    ap.add_argument("--warmup-tokens", type=int, default=16, help="tokens generated first to warm the cache")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--out", type=Path, default=OUT)


def cpu_description() -> dict:
    """The CPU a number came from: its model name, cores, and the vector flags that decide the kernels' paths."""
    flags = set()
    model = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
    vector = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
    return dict(model=model, cores=os.cpu_count(), vector_flags=vector)


def run_child(script: str, cfg: dict, load_aware: bool = True) -> dict:
    """Run `script --child CFG` in a fresh interpreter, once the machine is idle, and again while other processes
    took more than load.THRESHOLD_CORES during it (load.py); its last stdout line is the JSON result, returned with
    a `load` entry saying what foreign CPU the kept run met. `load_aware` False: at once and once (a benchmark of
    contention makes its own load), the load still measured and recorded."""
    from load import measured

    def once() -> dict:
        out = subprocess.run([sys.executable, script, "--child", json.dumps(cfg)], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"configuration {cfg} failed:\n{out.stderr}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    return measured(once) if load_aware else measured(once, threshold=float("inf"), max_wait_s=0.0, window_s=0.0)


def model_panels(rows: list[dict], width: float, height: float):
    """A figure with one panel per model (in order of first appearance): (figure, [(axes, model, its rows)])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(width * len(models), height), squeeze=False)
    return fig, [(ax, model, [r for r in rows if r["model"] == model]) for ax, model in zip(axes[0], models)]


def grouped_bars(ax, rows: list[dict], group: str, series: str, value) -> list[tuple[float, dict]]:
    """One bar per (group, series) of `rows` on `ax`, the groups along x in order of first appearance and each
    series a colour beside the others; a series not run in a group leaves its place empty. Returns (x, row) of each
    bar, for labels above them."""
    groups = list(dict.fromkeys(r[group] for r in rows))
    names = list(dict.fromkeys(r[series] for r in rows))
    width, bars = 0.8 / len(names), []
    for j, name in enumerate(names):
        by = {r[group]: r for r in rows if r[series] == name}
        placed = [(i + (j - (len(names) - 1) / 2) * width, by[g]) for i, g in enumerate(groups) if g in by]
        ax.bar([x for x, _ in placed], [value(r) for _, r in placed], width, label=name)
        bars += placed
    ax.set_xticks(range(len(groups)), groups)
    return bars


def write_results(out: Path, name: str, args: argparse.Namespace, body: dict, plot, items: list) -> None:
    """OUT/NAME.json (the CPU, the arguments and `body`) and OUT/NAME.png (`plot` of `items`), said on stdout."""
    (out / f"{name}.json").write_text(json.dumps({"cpu": cpu_description(), "args": vars(args) | {"out": str(out)},
                                                  **body}, indent=1))
    plot(items, out / f"{name}.png")
    print(f"wrote {out / name}.json and {name}.png")


def save_panels(fig, title: str, path: Path, legend_fontsize: float | None = None) -> None:
    """The y label and legend on the first panel, the title, and the PNG."""
    first = fig.axes[0]
    first.set_ylabel("ms per output token")
    first.legend(fontsize=legend_fontsize)
    save_figure(fig, title, path, dpi=120)


def save_figure(fig, title: str, path: Path, dpi: int = 110, title_size: float | None = None) -> None:
    """The title, the PNG, and the figure closed (a sweep draws many)."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, **({} if title_size is None else {"fontsize": title_size}))
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def rotated_rounds(script: str, configs: list[str], rounds: int, cfg: dict, bar) -> dict[str, list[dict]]:
    """Each configuration `rounds` times, each run in a fresh process (`cfg` plus its `config`), the order rotated
    every round so a drift of the machine spreads over all of them. Returns the runs' statistics per configuration."""
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for r in range(rounds):
        for config in configs[r % len(configs):] + configs[:r % len(configs)]:
            runs[config].append(run_child(script, dict(cfg, config=config)))
            bar.update()
    return runs


def median_row(stats: list[dict], base_tpot_s: float, quality: dict, medians: tuple[str, ...] = ()) -> dict:
    """One configuration's row: median TPOT, its speed-up over `base_tpot_s`, every run's TPOT (and their spread),
    median decode hit rate and bytes per token, the median of each of the runs' `medians` statistics, `quality`'s
    measures, and how many of its runs were kept under foreign load (load.py)."""
    median = lambda key: statistics.median(s[key] for s in stats)  # noqa: E731
    tpot = median("tpot_s")
    return dict(tpot_s=tpot, speedup=base_tpot_s / tpot, tpot_runs_s=[s["tpot_s"] for s in stats],
                tpot_spread_s=[min(s["tpot_s"] for s in stats), max(s["tpot_s"] for s in stats)],
                runs_under_load=sum(bool(s.get("load", {}).get("under_load")) for s in stats),
                hit_rate=median("decode_hit_rate"), expert_bytes_per_token=median("expert_bytes_per_token"),
                **{key: median(key) for key in medians}, perplexity_change=quality.get("perplexity_change"),
                top1_agreement=quality.get("top1_agreement"), kl=quality.get("kl"))
