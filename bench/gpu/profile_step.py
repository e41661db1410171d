"""Where a decode step's time goes on the GPU: torch's profiler over a few decode steps after a warm-up, and, from
its trace, each CUDA stream's busy time (the union of its kernels' and copies' intervals), how long the copy
stream and the compute stream ran at once, and the steps' wall time against max(copy time, compute time) — the
overlap issue 52 asks for (a step within 1.2x of that maximum) — under the profiler, and for the same call run again
unprofiled (`plain_*`: its TPOT against the profile's compute a step and its own bytes at the profile's copy rate).

    python bench/gpu/profile_step.py --model demo-fine-xl --expert-memory 25% --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "prompts" / "mixed.txt"


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two unions of intervals."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def streams(trace: dict) -> dict:
    """Per stream: busy seconds, and whether it ran copies (memcpy) or kernels; from a Chrome trace's GPU events."""
    spans: dict[int, dict] = {}
    for ev in trace.get("traceEvents", []):
        cat = ev.get("cat", "")
        if ev.get("ph") != "X" or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        stream = ev.get("args", {}).get("stream", -1)
        s = spans.setdefault(stream, {"intervals": [], "copies": 0, "kernels": 0, "copy_bytes": 0})
        s["intervals"].append((ev["ts"] * 1e-6, (ev["ts"] + ev["dur"]) * 1e-6))
        if cat == "gpu_memcpy":
            s["copies"] += 1
            s["copy_bytes"] += ev.get("args", {}).get("bytes", 0) or 0
        else:
            s["kernels"] += 1
    for s in spans.values():
        s["intervals"] = union(s["intervals"])
        s["busy_s"] = length(s["intervals"])
    return spans


def summarize(trace: dict, wall_s: float, steps: int) -> dict:
    spans = streams(trace)
    if not spans:
        return {"error": "no GPU events in the trace"}
    compute = max(spans, key=lambda k: spans[k]["kernels"])
    copy = [k for k in spans if k != compute and spans[k]["copies"]]
    copy_intervals = union([iv for k in copy for iv in spans[k]["intervals"]])
    comp = spans[compute]
    overlap = intersect(comp["intervals"], copy_intervals)
    copy_s = length(copy_intervals)
    busy = union([iv for sp in spans.values() for iv in sp["intervals"]])  # (any stream: the device at work)
    span = busy[-1][1] - busy[0][0]
    return {
        "steps": steps, "wall_s": wall_s, "step_s": wall_s / steps,
        # the share of the device's span with no stream at work: where the step waits on the host (2026-11-30's
        # H200 at 25%: about half)
        "device_idle_share": 1 - length(busy) / span if span > 0 else None,
        "compute_stream": compute, "compute_busy_s": comp["busy_s"], "compute_kernels": comp["kernels"],
        "copy_streams": copy, "copy_busy_s": copy_s, "copy_bytes": sum(spans[k]["copy_bytes"] for k in copy),
        "overlap_s": overlap, "overlap_share_of_copy": overlap / copy_s if copy_s else None,
        "step_over_max_busy": wall_s / max(comp["busy_s"], copy_s) if max(comp["busy_s"], copy_s) else None,
        "streams": {str(k): {kk: v for kk, v in s.items() if kk != "intervals"} for k, s in spans.items()},
    }


def unprofiled(summary: dict, stats: dict) -> dict:
    """The same call unprofiled (its generate stats) against the profile's busy times: its TPOT over the larger of
    a step's compute (the profile's compute stream, a step) and its copies (its own expert bytes a token at the
    profile's copy rate) — the overlap target without the profiler's host time."""
    compute = summary["compute_busy_s"] / summary["steps"]
    rate = summary["copy_bytes"] / summary["copy_busy_s"] if summary.get("copy_busy_s") else None
    copy = stats["expert_bytes_per_token"] / rate if rate else 0.0
    bound = max(compute, copy)
    return {"plain_tpot_s": stats["tpot_s"], "plain_decode_hit_rate": stats["decode_hit_rate"],
            "plain_expert_bytes_per_token": stats["expert_bytes_per_token"], "plain_copy_s": copy,
            "plain_compute_s": compute, "plain_step_over_max_busy": stats["tpot_s"] / bound if bound else None}


def host_functions(engine, prompt: list[int], steps: int, top: int = 30) -> dict:
    """The call once more under cProfile (its own cost roughly doubles the host's time, evenly): the functions the
    host spends most in, by their own time and with what they call, in ms a decode step — what a GPU step bound by
    the host spends it on, the CUDA calls and waits (`synchronize`, `cpu`) among them."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    stats = engine.generate([prompt], max_new_tokens=steps + 1, ignore_eos=True).stats
    profiler.disable()
    table = pstats.Stats(profiler).stats  # {(file, line, name): (calls, ncalls, tottime, cumtime, callers)}

    def rows(key: int) -> list[dict]:
        ranked = sorted(table.items(), key=lambda kv: -kv[1][key])[:top]
        return [{"function": f"{Path(f).name}:{line}({name})", "calls_per_step": nc / steps,
                 "own_ms_per_step": tt * 1e3 / steps, "with_callees_ms_per_step": ct * 1e3 / steps}
                for (f, line, name), (_, nc, tt, ct, _) in ranked]

    return {"tpot_s": stats["tpot_s"], "by_own_time": rows(2), "by_time_with_callees": rows(3)}


def engine_fields(config: dict) -> dict:
    """EngineConfig's fields from JSON: the two that are objects (substitution, precision) made from their fields."""
    from moetier.plan.precision import MixedPrecision
    from moetier.plan.substitute import Substitution

    made = {"substitution": Substitution, "precision": MixedPrecision}
    return {k: made[k](**v) if k in made and isinstance(v, dict) else v for k, v in config.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo-fine-xl")
    ap.add_argument("--expert-memory", default="25%")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--name", default="profile", help="file names in --out: NAME.json (summary), NAME-trace.json")
    ap.add_argument("--config", default="{}", help="EngineConfig fields as JSON (e.g. '{\"placement\": \"greedy\"}'; "
                    "substitution and precision as their classes' fields: '{\"substitution\": {\"alpha\": 0.35}}')")
    ap.add_argument("--plain-steps", type=int, default=24, help="decode steps of the unprofiled call after it")
    ap.add_argument("--host-memory", default=None, help="the host tier (a GPU run; default auto)")
    ap.add_argument("--host-profile", action="store_true", help="the same call once more under cProfile: the host's "
                    "time by Python function (`host_functions`: where the step waits on the host, and for what)")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from moetier import Engine

    args.out.mkdir(parents=True, exist_ok=True)
    lines = [line for line in PROMPTS.read_text().splitlines() if line.strip()]
    from moetier.config import HostMemory

    config = engine_fields(json.loads(args.config))
    if args.host_memory is not None:
        config["host_memory"] = HostMemory.parse(args.host_memory)
    with Engine.from_pretrained(args.model, expert_memory=args.expert_memory, device=args.device, progress=False,
                                **config) as engine:
        tokenizer = engine.tokenizer
        warm = tokenizer.encode(lines[0]) if tokenizer else list(range(3, 35))
        engine.generate([warm], max_new_tokens=16, ignore_eos=True)
        # one token of prompt: the call is decode steps alone, its prefill one more of the same size
        prompt = (tokenizer.encode(lines[1]) if tokenizer else [7])[:1]
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            out = engine.generate([prompt], max_new_tokens=args.steps + 1, ignore_eos=True)
            wall = time.perf_counter() - start
        # the same call again, longer and unprofiled: the profiler's own host time (12.6x max(copy, compute) a
        # step under it on the H200, 3.1x unprofiled) is not the step's
        plain = engine.generate([prompt], max_new_tokens=args.plain_steps + 1, ignore_eos=True).stats
        host = host_functions(engine, prompt, args.plain_steps) if args.host_profile else None
        graphs = engine.model.graphs  # (--config's cuda_graphs: the profiled steps replay the warm-up's captures,
        # the engine keeping its KV cache)
        graphs = None if graphs is None else dict(graphs.status)
    trace_path = args.out / f"{args.name}-trace.json"
    prof.export_chrome_trace(str(trace_path))
    trace = json.loads(trace_path.read_text())
    stats = out.stats
    decode_s = stats["tpot_s"] * (stats["new_tokens"] - 1)
    summary = summarize(trace, wall, args.steps + 1)
    summary.update(model=args.model, expert_memory=args.expert_memory, config=json.loads(args.config),
                   host_memory=args.host_memory, host_tier=stats.get("host_tier"),
                   tpot_s=stats["tpot_s"], ttft_s=stats["ttft_s"], decode_s=decode_s,
                   decode_hit_rate=stats["decode_hit_rate"], expert_bytes_per_token=stats["expert_bytes_per_token"],
                   graphs=graphs, host_functions=host)
    summary.update(unprofiled(summary, plain) if "compute_busy_s" in summary else {"plain_tpot_s": plain["tpot_s"]})
    (args.out / f"{args.name}.json").write_text(json.dumps(summary, indent=1))
    json.dump({k: v for k, v in summary.items() if k != "streams"}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
