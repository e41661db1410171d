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
with the decoder's experts resident (the paper's, §IV-D).

The merged deployments hold what moetier's own merge makes of each size (bench/switch_merge.py): a Switch-shaped
store at a reduced width with random experts (no Switch weights can be fetched here), merged by `moetier merge`'s
code on the trace's first 64 sequences (`--ratio`, by default the paper's parameter share, or `--adaptive`, Eq.
31–33); each layer's kept count sets the bytes at Switch-Base's width, and each expert's principal routes the
replayed requests. A table of sizes — parameters, weights whole and merged, the least device each offloaded
deployment needs, the reduced stores' measured bytes — puts the paper's reported figures beside ours.

    python bench/comoe_tables.py            # ~1 min; JSON, tables and plot in bench/out/comoe-tables/
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
# The sizes the paper reports (§IV-C, Figs. 5-14; "—" where it gives none): parameters, and the memory of the
# original, M-SMoE, E-Offload and CoMoE; for Switch-Base-32 it gives reductions against the original.
PAPER_SIZES = {
    8: dict(params="0.5 B", original="—", merged="—", offloaded="—", **{"merged+offloaded": "—"}),
    32: dict(params="1.98 B", original="—", merged="−62.6%", offloaded="−50%",
            **{"merged+offloaded": "merged −19.4%"}),
    64: dict(params="3.8–4.0 B", original="7.8", merged="—", offloaded="—", **{"merged+offloaded": "2.3"}),
    128: dict(params="7.4–7.9 B", original="15.6", merged="5.8", offloaded="—", **{"merged+offloaded": "4.7"}),
    256: dict(params="15.8 B", original="over 31", merged="11.7", offloaded="15.6", **{"merged+offloaded": "9.4"}),
}
PAPER_COLUMNS = ("original", "merged", "offloaded (encoder)", "merged+offloaded (encoder)")


def synthetic_trace(experts: int, fit, args):
    """Switch-Base-`experts`'s synthetic trace: the calibration sequences first, the replayed requests after."""
    from moetier.sim.shapes import SHAPES
    from moetier.trace.synthetic import generate_seq2seq

    shape = SHAPES[f"switch-base-{experts}"]
    return generate_seq2seq(fit, shape.num_layers, experts, shape.top_k, shape.encoder_layers, list(shape.moe_layers),
                            args.calibration + args.sequences, args.prompt_tokens, args.new_tokens, seed=experts,
                            model=shape.name)


def retention(args):
    from moetier.merge.plan import ADAPTIVE, AdaptiveRatio, FixedRatio

    return AdaptiveRatio(*ADAPTIVE[args.adaptive], label=args.adaptive) if args.adaptive else FixedRatio(args.ratio)


def merges(traces: dict, args) -> dict:
    """Each size merged for real (bench/switch_merge.py) on its trace's calibration sequences."""
    import tempfile

    from bench.switch_merge import merge_switch
    from moetier.progress import tqdm

    out = {}
    with tempfile.TemporaryDirectory(prefix="comoe-tables-") as work:
        for n in tqdm(SIZES, desc="merge Switch-shaped stores", unit="model"):
            out[n] = merge_switch(n, traces[n][0], retention(args), args.scope, Path(work))
    return out


def cells(args) -> tuple[list[dict], dict]:
    from bench.switch_merge import split_sequences
    from moetier.progress import tqdm
    from moetier.sim.deploy import DEPLOYMENTS, MergedLayers, fit, request_latency
    from moetier.sim.profile import HardwareProfile
    from moetier.sim.shapes import SHAPES
    from moetier.trace.importers import import_trace
    from moetier.trace.synthetic import fit_locality

    locality = fit_locality(import_trace(TRACES / "olmoe-1b-7b"))
    traces = {n: split_sequences(synthetic_trace(n, locality, args), args.calibration) for n in SIZES}
    merged = merges(traces, args)
    rows = []
    grid = [(p, limit, precision, n, d) for p in args.profiles.split(",") for limit in map(int, args.limits.split(","))
            for precision in args.precisions.split(",") for n in SIZES for d in DEPLOYMENTS]
    for profile_name, limit, precision, n, deployment in tqdm(grid, desc="deployments", unit="cell"):
        profile = HardwareProfile.load(profile_name)
        shape = SHAPES[f"switch-base-{n}"]
        held = MergedLayers(merged[n].groups) if deployment.merged else None
        host = args.host_gb * GB if args.host_gb is not None else profile.tiers[-1].bytes
        fitted = fit(shape, deployment, limit * GB, host, int(args.workspace_gb * GB), precision, held)
        row = {"profile": profile_name, "limit_gb": limit, "precision": precision, "model": shape.name,
               "experts": n, "deployment": deployment.name, "fits": fitted.fits, "why": fitted.why,
               "device_gb": fitted.device_bytes / GB, "host_gb": fitted.host_bytes / GB,
               "cache_slots": fitted.cache_slots, "offloaded_layers": len(fitted.offloaded_layers)}
        if fitted.fits:
            row.update(request_latency(traces[n][1], shape, deployment, fitted, profile, precision, merged=held))
        rows.append(row)
    return rows, merged


def store_sizes(merged: dict, args) -> list[dict]:
    """Per size, at the tables' first precision: parameters and weights whole and as merged (the merge's own
    per-layer counts at Switch-Base's width), the least device each of the paper's offloaded deployments needs (the
    encoder's experts offloaded, the decoder's resident; the workspace and one expert of cache included), the
    reduced-width stores' measured expert bytes — and the paper's figures beside."""
    from moetier.sim.deploy import Deployment, MergedLayers, fit
    from moetier.sim.shapes import SHAPES

    precision, limit = args.precisions.split(",")[0], 10 ** 15
    out = []
    for n, m in merged.items():
        shape = SHAPES[f"switch-base-{n}"]
        workspace = int(args.workspace_gb * GB)
        encoder_offloaded, both = Deployment(False, True, "encoder"), Deployment(True, True, "encoder")
        kept = sum(m.kept.values())
        encoder = [k for layer, k in m.kept.items() if layer < shape.encoder_layers]
        decoder = [k for layer, k in m.kept.items() if layer >= shape.encoder_layers]
        dense = shape.dense_bytes(precision) / GB
        out.append({"experts": n, "method": m.method,
                    "params_b": (shape.total_expert_params + shape.dense_bytes("fp32") / 4) / 1e9,
                    "merged_params_b": (kept * shape.expert_params + shape.dense_bytes("fp32") / 4) / 1e9,
                    "kept_encoder": encoder, "kept_decoder": decoder,
                    "original_gb": dense + len(m.kept) * n * shape.expert_bytes(precision) / GB,
                    "merged_gb": dense + kept * shape.expert_bytes(precision) / GB,
                    "offloaded_gb": fit(shape, encoder_offloaded, limit, limit, workspace, precision).device_bytes / GB,
                    "merged_offloaded_gb": fit(shape, both, limit, limit, workspace, precision,
                                               MergedLayers(m.groups)).device_bytes / GB,
                    "reduced_store_bytes": m.store_bytes, "reduced_merged_bytes": m.merged_bytes,
                    "paper": PAPER_SIZES[n]})
    return out


def sizes_table(sizes: list[dict], precision: str) -> str:
    def span(ks: list[int]) -> str:
        return f"{min(ks)}" if min(ks) == max(ks) else f"{min(ks)}–{max(ks)}"

    def cell(gb: float, whole: float, paper: str) -> str:
        return f"{gb:.1f} ({gb / whole - 1:+.0%}) · paper {paper}"

    out = ["| model | parameters · paper | kept a layer: encoder / decoder | weights whole, GB · paper | weights merged, "
           "GB · paper M-SMoE "
           "| least device, encoder offloaded, GB · paper E-Offload | least device, merged + encoder offloaded, GB · "
           "paper CoMoE | reduced-width "
           "stores' expert bytes, merged / whole |", "|---|" + "---|" * 7]
    for r in sizes:
        p, whole = r["paper"], r["original_gb"]
        out.append(f"| switch-base-{r['experts']} | {r['params_b']:.2f} B → {r['merged_params_b']:.2f} B · "
                   f"{p['params']} | {span(r['kept_encoder'])} / {span(r['kept_decoder'])} of {r['experts']} | "
                   f"{whole:.1f} · paper {p['original']} | {cell(r['merged_gb'], whole, p['merged'])} | "
                   f"{cell(r['offloaded_gb'], whole, p['offloaded'])} | "
                   f"{cell(r['merged_offloaded_gb'], whole, p['merged+offloaded'])} | "
                   f"{r['reduced_merged_bytes'] / r['reduced_store_bytes']:.1%} |")
    return "\n".join(out)


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
                    "Switch-Base-128's 7.4 B); fp32: the checkpoints'. The plot and the sizes take the first")
    ap.add_argument("--host-gb", type=float, help="host memory for offloaded experts (default: the profile's host "
                    "tier, bounded at what the paper states: the NUC's 32 GB of RAM, the Orin's CPU side 32 GB)")
    ap.add_argument("--workspace-gb", type=float, default=0.5, help="the runtime's share of the device")
    ap.add_argument("--ratio", type=float, default=0.3, help="the merge's fixed ratio; 0.3 keeps ~34%% of "
                    "Switch-Base-32's parameters, the paper's adaptive variant's 36.9%%")
    ap.add_argument("--adaptive", choices=("light", "medium", "heavy"), help="merge adaptively (Eq. 31-33, the "
                    "paper's preset) instead of at --ratio")
    ap.add_argument("--scope", choices=("all", "encoder"), default="all", help="which MoE layers merge: all (the "
                    "paper's M-SMoE and CoMoE rows, §IV-B: 11-16 experts kept in the encoder, 3-5 in the decoder), or "
                    "the encoder's alone (moetier merge's default for an encoder-decoder)")
    ap.add_argument("--calibration", type=int, default=64, help="sequences of the trace the merge calibrates on "
                    "(its head; the replayed requests follow)")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=OUT / "comoe-tables")
    args = ap.parse_args()
    if not 0 < args.ratio <= 1 or min(args.calibration, args.sequences, args.prompt_tokens, args.new_tokens) < 1:
        ap.error("--ratio must be in (0, 1]; --calibration, --sequences and the token counts at least 1")
    rows, merged = cells(args)
    precision = args.precisions.split(",")[0]
    sizes = store_sizes(merged, args)
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "tables.json.tmp"
    tmp.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                               "sizes": sizes, "precision_of_sizes": precision}, indent=1))
    tmp.replace(args.out / "tables.json")
    print(f"\n{sizes_table(sizes, precision)}")
    for profile in args.profiles.split(","):
        for limit in map(int, args.limits.split(",")):
            for precision in args.precisions.split(","):
                print(f"\n{profile}, {limit} GB device, {precision} (✓ with the simulated latency of a request; "
                      f"✗ with what it would need)\n{table(rows, profile, limit, precision)}")
    plot(rows, args, args.out / "tables.png")
    print(f"\nwrote {args.out / 'tables.json'}, {args.out / 'tables.png'}")


if __name__ == "__main__":
    main()
