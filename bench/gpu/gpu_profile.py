"""The GPU machine as a simulator profile (issue 52, item 8), calibrated from one run of bench/gpu/run.sh: what
moetier's GPU engine costs there, so `moetier sim --profile NAME` and sim_check.py price its runs.

    python bench/gpu/gpu_profile.py bench/gpu/results/2026-11-27-h200 --name h200-pcie5 --per-read-ms 0.1246 \\
        --out moetier/sim/profiles/h200-pcie5.json
    python bench/gpu/sim_check.py bench/gpu/results/2026-11-27-h200 --model olmoe-synth --tokens 12 --warmup 6 \\
        --profile moetier/sim/profiles/h200-pcie5.json --fit lru:25%     # prints the --per-read-ms that fits

Each figure and where it comes from (written into the profile's `sources`):
- the link: micro.py's copy of a 12 MiB expert from pinned host memory; its latency from a 1.5 MiB copy's rate;
- the disk tier (behind a bounded host tier): micro.py's O_DIRECT reads;
- the GPU: the device-to-device copy and bf16 matrix product KINDS.md records for the card nvidia-smi named; a call's
  overhead: a launch from Python (micro.py);
- an expert, per precision: a layer's 8 experts in one launch pair over 8 (micro.py's `gpu_layer8_*`, the engine's
  Triton path) where measured, else one expert as the engine computes it (`gpu_expert_*`), the 8-token point
  scaled as one expert's; the same figure for every expert shape (launch-bound at a decode's few tokens: OLMoE's
  and demo-fine-xl's experts have the same 6.3 M weights);
- each model's dense layer: its 100% row (every expert resident, batch 1) less its experts and the executor's
  planning, spread over its layers — the residual, so the 100% rows are exact by construction;
- the host's own work a load costs (`per_read_s`): fitted to one row (sim_check.py --fit), given here;
- the host CPU: a cold 12 MiB bf16 expert on its cores (micro.py) as its memory bandwidth; its FLOP/s assumed
  (`--cpu-tflops`); the executor's and a predictor's time a MoE layer from `moetier calibrate` (`--executor-ms`,
  `--predict-ms`: the GPU machine's own host work is not timed apart);
- with `--host-time FILE...` (host_time.py's JSON: lru at two budgets below 100% at least, and the modes to price),
  the host thread that issues the GPU's work (the profile's `host_issue`: bench/gpu/host_figures.py), its figures
  times `--host-scale` (sim_check.py --fit prints the one that brings a row to its measurement); `--per-read-ms`
  is then best left 0: a load's host work is `host_issue.load_s`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

EXPERT_BYTES = 12 * 2**20  # micro.py's expert: OLMoE-1B-7B's, 3 x 2048 x 1024 bf16
SMALL_BYTES = 1.5 * 2**20  # micro.py's small copy
# what KINDS.md records for the cards this workplace lends (a device-to-device copy through PyTorch counting bytes
# read and written; an 8192-cubed bf16 product on random data), and the GPU memory a run may use
KNOWN_GPUS = {
    "H200": {"copy": 4.3e12, "bf16": 788e12, "fp32": 67e12, "memory": 140e9},
    "H100": {"copy": 3.0e12, "bf16": 798e12, "fp32": 67e12, "memory": 78e9},
}
BENCH_SHAPES = {"olmoe-synth": "olmoe-1b-7b", "dsv2-lite-synth": "deepseek-v2-lite"}  # bench_gpu.py's random models


def card(name: str) -> tuple[str, dict]:
    for key, figures in KNOWN_GPUS.items():
        if key in name:
            return key, figures
    raise SystemExit(f"gpu_profile: no figures for a {name!r} (known: {', '.join(KNOWN_GPUS)}); add its KINDS.md "
                     f"row to KNOWN_GPUS")


def expert_points(micro: dict, precision: str) -> tuple[list[list[float]], str]:
    """[[1, s], [8, s]] for one expert at `precision`, and where it came from."""
    one = [micro.get(f"gpu_expert_{precision}_T{n}_s") for n in (1, 8)]
    layer = micro.get(f"gpu_layer8_{precision}_T1_s")
    if layer is not None:
        t1 = layer / 8
        t8 = t1 * one[1] / one[0] if None not in one else t1
        return [[1.0, _r(t1)], [8.0, _r(t8)]], f"{precision}: a layer's 8 in one launch pair, {layer * 1e6:.0f} us"
    if None in one:
        raise SystemExit(f"gpu_profile: micro.json has no {precision} expert")
    return [[1.0, _r(one[0])], [8.0, _r(one[1])]], f"{precision}: one expert, {one[0] * 1e6:.0f}/{one[1] * 1e6:.0f} us"


def shape_of(model: str):
    """A bench model's shape: a known one for the random models, else its store's."""
    from moetier.sim.shapes import SHAPES, ModelShape

    if model in BENCH_SHAPES:
        return SHAPES[BENCH_SHAPES[model]]
    from moetier.resolve import inflated_builtins, resolve_model
    from moetier.store.inflate import intermediate_for
    from moetier.store.store import Store

    base = inflated_builtins().get(model)  # (an -xl model: its base's shape, the experts as inflating makes them,
    store = Store(resolve_model(base or model, progress=False))  # without building it)
    shape = ModelShape.from_spec(store.spec, model, store.manifest.native_precision)
    return dataclasses.replace(shape, moe_intermediate_size=intermediate_for(store)) if base else shape


def dense_rows(results: Path) -> dict[str, float]:
    """model -> TPOT of its 100% lru row at batch 1 (every expert resident): the median of its rounds."""
    from runs import fold, load

    out = {}
    for r in fold(load(results)[1]):
        if (r.get("engine") == "moetier" and r.get("mode") == "lru" and r.get("budget") == "100%"
                and r.get("batch") == 1 and r.get("tier") in (None, "host")):
            out.setdefault(r["model"], r["tpot_s"])
    return out


def host_expert(micro: dict, results: Path, cpu_from: Path | None) -> tuple[dict, str]:
    """The micro.json whose host-CPU figures price the CPU lane — this run's, or where its CPU part failed (the
    2026-11-30 run's did), another run's on the same machine kind (`--cpu-from`) — and a word on which."""
    if "cpu_expert_bf16_T1_native_cold_s" in micro:
        return micro, ""
    if cpu_from is None:
        why = micro.get("cpu_error", "not timed")
        raise SystemExit(f"gpu_profile: {results / 'micro.json'} has no host-CPU expert ({why}); give --cpu-from RUN, "
                         "a run on the same machine kind that timed one")
    other = json.loads((cpu_from / "micro.json").read_text())
    if "cpu_expert_bf16_T1_native_cold_s" not in other:
        raise SystemExit(f"gpu_profile: --cpu-from {cpu_from} has no host-CPU expert either")
    return other, f", in {cpu_from.as_posix()}: this run's CPU part failed"


def build(results: Path, name: str, per_read_s: float, executor_s: float, predict_s: float, cpu_flops: float,
          cpu_from: Path | None = None, host_time: list[Path] | None = None, host_scale: float = 1.0,
          call_s: float | None = None):
    from moetier.sim.profile import Device, HardwareProfile, Linear, Measured, Piecewise, Tier

    micro = json.loads((results / "micro.json").read_text())
    host, whence = host_expert(micro, results, cpu_from)
    gpu, figures = card(micro["device"])
    rate = micro["h2d_pinned_expert_12MiB_GBps"] * 1e9
    latency = SMALL_BYTES / (micro["h2d_pinned_expert_1.5MiB_GBps"] * 1e9) - SMALL_BYTES / rate
    disk = micro["disk_odirect_12MiB_GBps"] * 1e9
    cold = host["cpu_expert_bf16_T1_native_cold_s"]
    launch = micro["gpu_launch_host_s"]
    experts = {p: expert_points(micro, p) for p in ("bf16", "int8", "int4", "int2")}
    sources = [
        f"{results.as_posix()}: micro.json's device {micro['device']}; made by bench/gpu/gpu_profile.py",
        f"tier: host to device from pinned memory {rate / 1e9:.1f} GB/s a 12 MiB expert; latency {latency * 1e6:.0f} "
        f"us from a 1.5 MiB copy's rate ({micro['h2d_pinned_expert_1.5MiB_GBps']:.1f} GB/s) against 12 MiB's",
        f"GPU: the device-to-device copy ({figures['copy'] / 1e12:.1f} TB/s) and bf16 product "
        f"({figures['bf16'] / 1e12:.0f} TFLOP/s) KINDS.md records for an {gpu}; call overhead "
        f"{launch * 1e6:.1f} us, a launch from Python (micro.py)",
        "experts (micro.py, CUDA events; one figure for every expert shape): " + "; ".join(
            why for _, why in experts.values()),
        f"executor {executor_s * 1e3:.3f} ms and predictor {predict_s * 1e3:.3f} ms a MoE layer: `moetier calibrate` "
        "(the GPU machine's own host work is not timed apart: an estimate)",
        f"host CPU: {EXPERT_BYTES / cold / 1e9:.1f} GB/s, a cold 12 MiB bf16 expert in {cold * 1e6:.0f} us on its "
        f"{host.get('cpu_threads', '?')} threads (micro.py{whence}); its FLOP/s assumed {cpu_flops / 1e12:g} TFLOP/s",
        f"per_read_s {per_read_s * 1e3:.4f} ms: the host's own work a load costs, fitted to one row (sim_check.py "
        "--fit); every other row is left to validate it",
        f"disk tier: O_DIRECT reads of 12 MiB into pinned memory, {disk / 1e9:.2f} GB/s (micro.py); used behind a "
        "bounded host tier only (moetier sim --host-memory)",
    ]
    measured = []
    for model, tpot in dense_rows(results).items():
        shape = shape_of(model)
        e1 = experts[shape.precision][0][0][1]
        moe = len(shape.moe_layers)
        dense = (tpot - moe * (shape.top_k * e1 + executor_s)) / shape.num_layers
        sources.append(f"{model}'s dense layer {dense * 1e3:.4f} ms: its 100% row ({tpot * 1e3:.2f} ms a token, "
                       f"{shape.num_layers} layers) less {moe} x ({shape.top_k} experts + the executor)")
        for precision, (points, _) in experts.items():
            measured.append(Measured(shape.hidden_size, shape.moe_intermediate_size, precision,
                                     Piecewise(tuple(tuple(p) for p in points)), Linear(0.0, _r(dense)),
                                     Linear(0.0, 0.0)))
    issue = None
    if host_time:
        from host_figures import host_issue

        costs = dict(micro.get("cuda_call_host_s") or {})
        if "gpu_rope_T1_host_s" in micro:  # (a Triton launch from Python, host_time.py --kernels triton's: the
            costs.setdefault("triton launch", micro["gpu_rope_T1_host_s"])  # rotation's, one launch)
        issue, lines = host_issue(host_time, launch if call_s is None else call_s, host_scale, predict_s, mode_keys,
                                  costs or None)
        sources += lines
    flops = {p: figures["bf16"] for p in ("bf16", "fp16", "int8", "int4", "int2")} | {"fp32": figures["fp32"]}
    devices = {"gpu": Device("gpu", figures["copy"], flops, _r(launch)),
               "cpu": Device("cpu", _r(EXPERT_BYTES / cold), {p: cpu_flops for p in flops}, 5e-6)}
    tiers = (Tier(f"host memory to an {gpu} (pinned)", _r(rate), _r(latency), 1.0, None, 0.0, per_read_s),
             Tier("local disk, O_DIRECT (behind a host tier: --host-memory)", _r(disk), 0.0, 1.0, None, 0.0, 0.0))
    return HardwareProfile(name, int(figures["memory"]), tiers, devices, "gpu",
                           f"The machine of the GPU run in {results.name}: one {micro['device']}, the experts in "
                           "pinned host memory behind PCIe, as moetier's GPU engine runs it (its step times, not "
                           "the chip's)", tuple(sources), Linear(0.0, executor_s), tuple(measured),
                           Linear(0.0, predict_s), issue)


def mode_keys(mode: str) -> tuple[str, ...]:
    """A bench_gpu.py mode's mechanism keys (moetier/sim/host_issue.py)."""
    from bench_gpu import POLICY, modes

    from moetier.sim.host_issue import mechanism_keys

    c = modes()[mode]
    mixed = c.get("precision")
    return mechanism_keys(c.get("policy", POLICY), c.get("prefetch", "none"), c.get("predictor"),
                          mixed.mode if mixed is not None and mixed.mixed else None,
                          "smoe" if c.get("substitution") is not None else None, c.get("placement", "none"))


def _r(x: float) -> float:
    return float(f"{x:.4g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="a bench/gpu/results/... folder (micro.json, bench-*.json)")
    ap.add_argument("--name", required=True, help="the profile's name (`moetier sim --profile NAME`)")
    ap.add_argument("--out", type=Path, help="where to write it (default: bench/out/gpu-profile/NAME.json)")
    ap.add_argument("--per-read-ms", type=float, default=0.0, help="the host's work a load costs (sim_check --fit)")
    ap.add_argument("--executor-ms", type=float, default=0.209, help="the executor's planning a MoE layer")
    ap.add_argument("--predict-ms", type=float, default=0.073, help="a predictor's scoring a MoE layer")
    ap.add_argument("--cpu-tflops", type=float, default=2.0, help="the host CPU's FLOP/s (assumed)")
    ap.add_argument("--cpu-from", type=Path, help="a run on the same machine kind whose micro.json prices the host "
                    "CPU, where this run's CPU part failed")
    ap.add_argument("--host-time", type=Path, nargs="+", help="host_time.py's JSON files: the host thread's "
                    "figures (host_issue)")
    ap.add_argument("--host-scale", type=float, default=1.0, help="the GPU machine's host against the CPU that "
                    "ran host_time.py (sim_check.py --fit prints it; default 1)")
    ap.add_argument("--call-us", type=float, help="a CUDA call's host time where micro.py did not time it by name "
                    "(default: micro.py's launch from Python)")
    args = ap.parse_args()
    bad = [p for p in args.host_time or () if not p.is_file()]
    if bad or args.host_scale <= 0 or (args.call_us is not None and args.call_us < 0):
        why = f"no file {', '.join(map(str, bad))}" if bad else "--host-scale must be > 0 and --call-us >= 0"
        print(f"gpu_profile: error: {why}", file=sys.stderr)
        raise SystemExit(1)
    profile = build(args.results, args.name, args.per_read_ms / 1e3, args.executor_ms / 1e3,
                    args.predict_ms / 1e3, args.cpu_tflops * 1e12, args.cpu_from, args.host_time, args.host_scale,
                    None if args.call_us is None else args.call_us * 1e-6)
    out = args.out or Path(__file__).resolve().parents[1] / "out" / "gpu-profile" / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    print(f"wrote {out}")
    for line in profile.sources:
        print(f"  {line}")


if __name__ == "__main__":
    main()
