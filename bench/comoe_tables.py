"""CoMoE's Tables I–II in the simulator: which of original / merged / offloaded / merged+offloaded Switch-Base-8…256
fit under an 8 GB and a 4 GB device, and what a request costs each, on the paper's own machines.

For each CoMoE profile (`nuc-a500`: the NUC 13 Pro's 8 GB RTX A500 beside 32 GB of RAM; `jetson-orin-64`: the AGX
Orin's 64 GB, 32 GB of it the GPU's), each device limit and each precision, every Switch-Base size — encoder and
decoder, as `moetier sim` shapes them — is held each way moetier/sim/deploy.py names: fits by bytes (the device
holds the dense weights, the resident experts, 0.5 GB of workspace and at least one layer's top-k of cache; host
memory, bounded at the RAM the paper states, holds what is offloaded), and what fits is timed by replaying a
synthetic encoder-decoder trace (8 requests of 128 prompt tokens and 16 new tokens, batch 1 as the paper's
latency runs; skew and locality fitted to the real OLMoE trace in data/traces) through the simulator,
LRU, the cache filled first. Offloading is shown both ways: every MoE layer's (moetier's), and the encoder's alone
with the decoder's experts resident (the paper's, §IV-D). The merged variant is a fixed-ratio one (`--ratio`,
by default the paper's parameter share).

    python bench/comoe_tables.py            # ~2 min; JSON, tables and plot in bench/out/comoe-tables/
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import OUT  # noqa: E402

TRACES = ROOT / "data" / "traces"  # the real traces, shipped in the repository
SIZES = (8, 32, 64, 128, 256)
GB = 10 ** 9

# The paper's Tables I and II (✓ deployable): original, M-SMoE, E-Offload, CoMoE.
PAPER = {8: {8: "✓✓✓✓", 32: "✗✓✓✓", 64: "✗✓✓✓", 128: "✗✓✓✓", 256: "✗✗✗✗"},
         4: {8: "✓✓✓✓", 32: "✗✓✓✓", 64: "✗✓✗✓", 128: "✗✗✗✗"}}
PAPER_COLUMNS = ("original", "merged", "offloaded (encoder)", "merged+offloaded (encoder)")


def synthetic_trace(experts: int, fit, args):
    from moetier.sim.shapes import SHAPES
    from moetier.trace.synthetic import generate_seq2seq

    shape = SHAPES[f"switch-base-{experts}"]
    return generate_seq2seq(fit, shape.num_layers, experts, shape.top_k, shape.encoder_layers, list(shape.moe_layers),
                            args.sequences, args.prompt_tokens, args.new_tokens, seed=experts, model=shape.name)


def cells(args) -> list[dict]:
    from moetier.progress import tqdm
    from moetier.sim.deploy import DEPLOYMENTS, fit, merged_shape, request_latency
    from moetier.sim.profile import HardwareProfile
    from moetier.sim.shapes import SHAPES
    from moetier.trace.importers import import_trace
    from moetier.trace.synthetic import fit_locality

    locality = fit_locality(import_trace(TRACES / "olmoe-1b-7b"))
    traces = {n: synthetic_trace(n, locality, args) for n in SIZES}
    rows = []
    grid = [(p, limit, precision, n, d) for p in args.profiles.split(",") for limit in map(int, args.limits.split(","))
            for precision in args.precisions.split(",") for n in SIZES for d in DEPLOYMENTS]
    for profile_name, limit, precision, n, deployment in tqdm(grid, desc="deployments", unit="cell"):
        profile = HardwareProfile.load(profile_name)
        shape = SHAPES[f"switch-base-{n}"]
        held = merged_shape(shape, args.ratio) if deployment.merged else shape
        host = args.host_gb * GB if args.host_gb is not None else profile.tiers[-1].bytes
        fitted = fit(held, deployment, limit * GB, host, int(args.workspace_gb * GB), precision)
        row = {"profile": profile_name, "limit_gb": limit, "precision": precision, "model": shape.name,
               "experts": n, "deployment": deployment.name, "fits": fitted.fits, "why": fitted.why,
               "device_gb": fitted.device_bytes / GB, "host_gb": fitted.host_bytes / GB,
               "cache_slots": fitted.cache_slots, "offloaded_layers": len(fitted.offloaded_layers)}
        if fitted.fits:
            row.update(request_latency(traces[n], held, deployment, fitted, profile, precision))
        rows.append(row)
    return rows


def table(rows: list[dict], profile: str, limit: int, precision: str) -> str:
    from moetier.sim.deploy import DEPLOYMENTS

    names = [d.name for d in DEPLOYMENTS]
    out = [f"| model | {' | '.join(names)} | paper: {' / '.join(PAPER_COLUMNS)} |",
           "|---|" + "---|" * (len(names) + 1)]
    for n in SIZES:
        got = {r["deployment"]: r for r in rows if (r["profile"], r["limit_gb"], r["precision"], r["experts"]) ==
               (profile, limit, precision, n)}
        cell = [f"✓ {got[d]['request_s'] * 1e3:.0f} ms" if got[d]["fits"] else f"✗ ({got[d]['device_gb']:.1f} GB"
                + (f", host {got[d]['host_gb']:.0f} GB)" if "host" in got[d]["why"] else ")") for d in names]
        paper = " ".join(PAPER[limit].get(n, "—")) if limit in PAPER else "—"
        out.append(f"| switch-base-{n} | {' | '.join(cell)} | {paper} |")
    return "\n".join(out)


def plot(rows: list[dict], args, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moetier.sim.deploy import DEPLOYMENTS

    profiles, limits = args.profiles.split(","), [int(x) for x in args.limits.split(",")]
    precision = args.precisions.split(",")[0]
    fig, axes = plt.subplots(len(profiles), len(limits), figsize=(5.5 * len(limits), 4 * len(profiles)),
                             squeeze=False, sharey=True)
    for i, profile in enumerate(profiles):
        for j, limit in enumerate(limits):
            ax = axes[i][j]
            for d, marker, style in zip(DEPLOYMENTS, "osv^Dx", ["-", "--", "-", "--", ":", ":"]):
                pts = [(r["experts"], r["request_s"] * 1e3) for r in rows if r["fits"] and (
                    r["profile"], r["limit_gb"], r["precision"], r["deployment"]) == (profile, limit, precision, d.name)]
                if pts:
                    ax.plot(*zip(*pts), marker=marker, linestyle=style, alpha=0.8, label=d.name)
            ax.set(xscale="log", yscale="log", xticks=SIZES, xticklabels=[str(n) for n in SIZES],
                   title=f"{profile}, {limit} GB device, {precision}", xlabel="experts a layer (Switch-Base-N)",
                   ylabel="simulated request latency (ms)" if j == 0 else None)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("CoMoE Tables I–II in the simulator: deployments that fit, and their latency (missing = does not fit)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="nuc-a500,jetson-orin-64")
    ap.add_argument("--limits", default="8,4", help="device memory limits, GB")
    ap.add_argument("--precisions", default="bf16,fp32", help="bf16: the paper's sizes are 2-byte ones (15.6 GB for "
                    "Switch-Base-128's 7.4 B); fp32: the checkpoints'. The plot draws the first")
    ap.add_argument("--host-gb", type=float, help="host memory for offloaded experts (default: the profile's host "
                    "tier, bounded at what the paper states: the NUC's 32 GB of RAM, the Orin's CPU side 32 GB)")
    ap.add_argument("--workspace-gb", type=float, default=0.5, help="the runtime's share of the device")
    ap.add_argument("--ratio", type=float, default=0.3, help="the merged variant's fixed ratio; 0.3 keeps ~36%% of "
                    "Switch-Base-32's parameters, the paper's adaptive variant's 36.9%%")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=OUT / "comoe-tables")
    args = ap.parse_args()
    rows = cells(args)
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "tables.json.tmp"
    tmp.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    tmp.replace(args.out / "tables.json")
    for profile in args.profiles.split(","):
        for limit in map(int, args.limits.split(",")):
            for precision in args.precisions.split(","):
                print(f"\n{profile}, {limit} GB device, {precision} (✓ with the simulated latency of a request; "
                      f"✗ with what it would need)\n{table(rows, profile, limit, precision)}")
    plot(rows, args, args.out / "tables.png")
    print(f"\nwrote {args.out / 'tables.json'}, {args.out / 'tables.png'}")


if __name__ == "__main__":
    main()
