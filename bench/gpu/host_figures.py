"""A simulator profile's host thread (`host_issue`, moetier/sim/host_issue.py) from host_time.py's measurements.

host_time.py times the GPU engine's own Python a MoE layer on any CPU, CUDA stood in for, and counts the CUDA calls it
makes through the stand-ins. Its rows become figures so:
- a row's host cost: its Python time a layer plus its CUDA calls, each at what micro.py timed that call at on the
  GPU machine (`cuda_call_host_s`) where the row counts them by name and micro.py timed it, else `call_s`;
- on-demand LRU's rows at budgets below 100% (at least two) fitted to a line in the copies a layer queues (loads and
  prefetches): its slope is `load_s`, its intercept less the 100% row's cost (the resident layer's, which the dense
  part's measured time already carries) the routed layer's own work, `launch_s`;
- each other mode's cost beyond that line at its own copies, what its mechanism adds (`mechanism_s`; a prefetcher's
  less the profile's predictor time, which the simulator adds where any predictor runs; negative ones read as 0);
- every figure times `scale`: the GPU machine's host against the CPU that measured (1 where it measured itself;
  sim_check.py --fit finds the scale that brings one row to its measurement).
`plan_s`, the host's work between a layer's routing and its first copy, is left 0: on the 2026-11-30 H200 run the
10% row (a layer's copies 2.0 ms on the link, its step 2.86 ms, 0.82 of them the dense part) leaves it no room, so
the on-demand plan is counted in `launch_s`, beside the copies."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

LAYERS = 16  # host_time.py's default MoE layers, for files that do not say


def rows_of(paths: list[Path], call_s: float, costs: dict[str, float] | None = None) -> dict[tuple[str, str], dict]:
    """(mode, budget) -> medians over every file's rounds: host s (Python and CUDA calls), loads and prefetches a
    layer. `costs`: a CUDA call's host s by name (micro.py's), `call_s` for one it does not name."""
    got: dict[tuple[str, str], list[dict]] = {}
    for path in paths:
        d = json.loads(path.read_text())
        per_layer = d["tokens"] * d.get("layers", LAYERS)  # (counts over the measured call's decode steps)
        for r in d["rows"]:
            by_name = r.get("cuda_calls_by_name_per_layer") or {"": r["cuda_calls_per_layer"]}
            calls_s = sum(n * (costs or {}).get(name, call_s) for name, n in by_name.items())
            got.setdefault((r["mode"], r["budget"]), []).append(
                {"host_s": r["host_ms_per_layer"] / 1e3 + calls_s,
                 "copies": (r["loads"] + r.get("prefetches", 0)) / per_layer})
    return {key: {f: statistics.median(x[f] for x in xs) for f in ("host_s", "copies")} for key, xs in got.items()}


def host_issue(paths: list[Path], call_s: float, scale: float, predict_s: float, keys_of,
               costs: dict[str, float] | None = None) -> tuple[object, list[str]]:
    """The HostIssue and the lines saying where each figure came from. `keys_of(mode)`: a mode's mechanism keys;
    `costs`: micro.py's CUDA calls' host s by name, where it timed them."""
    from moetier.sim.host_issue import HostIssue

    rows = rows_of(paths, call_s, costs)
    cost = {k: r["host_s"] for k, r in rows.items()}
    lru = sorted((rows[k]["copies"], cost[k]) for k in rows if k[0] == "lru" and k[1] != "100%")
    if len({x for x, _ in lru}) < 2 or ("lru", "100%") not in cost:
        raise SystemExit("gpu_profile: --host-time needs lru at two budgets below 100% and lru at 100% "
                         "(host_time.py --modes lru --budget B, for two B)")
    xs, ys = [x for x, _ in lru], [y for _, y in lru]
    slope, intercept = _line(xs, ys)
    resident = cost["lru", "100%"]
    mechanisms: dict[str, float] = {}
    said = []
    for (mode, budget), c in sorted(cost.items()):
        if mode == "lru":
            continue
        extra = c - (intercept + slope * rows[mode, budget]["copies"])
        keys = [k for k in keys_of(mode) if k != "policy:lru"]
        if not keys:
            continue
        key = next((k for k in keys if k.startswith("prefetch:")), keys[0])  # (a prefetcher's with its predictor's)
        less = predict_s if key.startswith("prefetch:") else 0.0
        mechanisms[key] = max(0.0, scale * extra - less)
        said.append(f"{key} {mechanisms[key] * 1e3:.3f} ms ({mode} at {budget}: {c * 1e3:.3f} ms, "
                    f"{extra * 1e3:+.3f} beyond lru's line at its {rows[mode, budget]['copies']:.2f} copies"
                    + (f", less the predictor's {predict_s * 1e3:.3f}" if less else "") + ")")
    issue = HostIssue(0.0, max(0.0, scale * slope), max(0.0, scale * (intercept - resident)), mechanisms)
    where = ", ".join(p.as_posix() for p in paths)
    priced = (f"at micro.py's times ({', '.join(f'{k} {v * 1e6:.1f} us' for k, v in costs.items())}; "
              f"{call_s * 1e6:.1f} us one it did not time)" if costs else f"at {call_s * 1e6:.1f} us each")
    lines = [f"host_issue from host_time.py ({where}; each row its Python a MoE layer plus its CUDA calls "
             f"{priced}), times {scale:g} (the GPU machine's host against the measuring CPU)",
             f"host_issue: lru's rows {', '.join(f'{x:.2f} copies {y * 1e3:.3f} ms' for x, y in lru)}: "
             f"load_s {issue.load_s * 1e3:.4f} ms a copy; launch_s {issue.launch_s * 1e3:.3f} ms (the line at 0 "
             f"copies, {intercept * 1e3:.3f} ms, less lru at 100%, {resident * 1e3:.3f}); plan_s 0 (counted in "
             "launch_s: bench/gpu/host_figures.py says why)",
             "host_issue mechanisms: " + ("; ".join(said) or "none measured")]
    return issue, lines


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares: (slope, intercept)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx
