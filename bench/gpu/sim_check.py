"""The simulator against the GPU run (issue 52, item 8): each of bench_gpu.py's rows of one model replayed on the
`h200-pcie5` profile — calibrated from that run's micro-benchmarks and its 100% row — through the engine's own
layer step, and the simulated TPOT held against the measured one.

The routing is recorded here, on the CPU, with bench_gpu.py's own prompts (its warm-up call, then its measured
call; exact mode routes alike on any device, but for bf16 rounding), and replayed as bench_sim_validation.py
replays the CPU engine's — CPU-assisted compute too (`cpu-assist`, `cpu-offload`: the profile's host CPU is the
second lane). Rows the simulator does not model are left out, and said: the disk rows, `--kernels torch`, the
`fifo` copy order (`prefetch-hobbit-fifo`: the simulator queues prefetches behind on-demand loads, as the engine's
default does), and batches above 1 (bench_gpu.py's batch rows draw their prompts round-robin). `--fit MODE:BUDGET`
prints the per-load host figure that makes that row exact (gpu_profile.py's `--per-read-ms`). Beside each row, what
its mechanisms did in both (host runs, substituted assignments, prefetches issued): a row whose mechanism acted in
one and not the other compares two plans — said under the table, and counted as any other row.

    python bench/gpu/sim_check.py bench/gpu/results/2026-11-27-h200 --model demo-fine-xl
    python bench/gpu/sim_check.py bench/gpu/results/2026-11-27-h200 --model olmoe-synth --tokens 12 --warmup 6
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "gpu"))

from runs import acted, acts_in_words, fold, load, plans_differ, ranking, rounds, spread  # noqa: E402

MODES = {"lru": "none", "comoe": "none", "hobbit": "precision:hobbit", "prefetch-hobbit": "hobbit:stacked-gates",
         "prefetch-presched": "presched:stacked-gates", "prefetch-oracle": "hobbit:oracle",
         "substitute": "substitute:0.35", "cpu-assist": "placement:greedy", "cpu-offload": "placement:cpu-offload"}


def record(model: str, prompt_len: int, warmup: int, tokens: int, out: Path):
    """The routing of bench_gpu.py's two calls (warm-up, measured), exact mode, every expert resident."""
    from bench_gpu import prompt_ids, store_of

    from moetier import Engine
    from moetier.paths import default_cache_dir
    from moetier.trace.record import TraceRecorder

    with Engine.from_pretrained(store_of(model, default_cache_dir()), expert_memory="100%", progress=False) as engine, \
            TraceRecorder(engine, gate_inputs=True) as recorder:
        warm, measured = prompt_ids(engine, model, 1, prompt_len)
        engine.generate(warm, max_new_tokens=warmup, ignore_eos=True)
        engine.generate(measured, max_new_tokens=tokens, ignore_eos=True)
        trace = recorder.trace(["warm-up", "measured"])
    trace.save(out, overwrite=True)
    return trace


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="a bench/gpu/results/... folder (bench-*.json)")
    ap.add_argument("--model", default="demo-fine-xl")
    ap.add_argument("--profile", default="h200-pcie5")
    ap.add_argument("--tokens", type=int, default=24, help="bench_gpu.py's --tokens for this model")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "gpu-sim-check")
    ap.add_argument("--budget", default="25%", help="where the modes are ranked (bench_gpu.py's --mode-budget)")
    ap.add_argument("--fit", metavar="MODE:BUDGET", help="print the host's work a load costs (the profile's first tier's "
                    "per_read_s) that makes this row's simulated TPOT its measured one (gpu_profile.py --per-read-ms); "
                    "with a profile that prices the host thread (host_issue), the factor on its figures that does "
                    "(gpu_profile.py --host-scale)")
    args = ap.parse_args(argv)
    import dataclasses

    from bench_gpu import POLICY, PRELOADED, modes, store_of
    from bench_sim_validation import replay

    from moetier.paths import default_cache_dir
    from moetier.plan.precision import MixedPrecision
    from moetier.policy_files import load_thresholds
    from moetier.sim.profile import HardwareProfile
    from moetier.store.store import Store
    from moetier.store.variants import add_precisions

    store = Store(store_of(args.model, default_cache_dir()))
    if "int4" not in store.manifest.precisions:  # (HOBBIT's low copies, as the GPU run had them)
        add_precisions(store.path, "int4", progress=False)
        store = Store(store.path)
    entry_bytes = {p: layout.blob_bytes for p, layout in store.manifest.precisions.items()}
    # HOBBIT as the engine resolved it there: as the row records it (bench_gpu.py's rows do now); for a row of an
    # earlier run, the model's fitted thresholds, the int4 low copy and the rule of the engine then — a cached copy
    # run at the precision it is held at (`as-held`; the paper's by-gate rule came after the first GPU runs)
    hobbit = dataclasses.asdict(MixedPrecision("hobbit", low="int4", cached="as-held").with_thresholds(
        load_thresholds(store.trained_dir())))

    rows = [r for r in fold(load(args.results)[1]) if r.get("model") == args.model and r.get("engine") == "moetier"]
    args.out.mkdir(parents=True, exist_ok=True)
    trace = record(args.model, args.prompt_len, args.warmup, args.tokens, args.out / f"{args.model}-trace")
    profile = HardwareProfile.load(args.profile)
    out, skipped = [], []

    def simulated(r: dict, profile) -> dict:
        cfg = {"model": str(store.path), "policy": modes()[r["mode"]].get("policy", POLICY), "prefetch": MODES[r["mode"]]}
        preload = r["budget"] == "100%" or r["mode"] in PRELOADED
        return replay(trace, profile, cfg, r["expert_slots"], store.native_layout.blob_bytes, 2, preload,
                      entry_bytes, (r.get("precision") or hobbit) if r["mode"] == "hobbit" else None)

    for r in rows:
        if r["mode"] not in MODES or r["batch"] != 1 or r.get("tier") != "host":
            skipped.append(f"{r['mode']} {r.get('tier')} {r['budget']} b{r['batch']}")
            continue
        sim = simulated(r, profile)
        out.append({"mode": r["mode"], "budget": r["budget"], "real_tpot_s": r["tpot_s"],
                    "real_tpot_rounds_s": rounds(r), **sim, "ratio": sim["sim_tpot_s"] / r["tpot_s"],
                    "real_hit_rate": r["decode_hit_rate"], "acted": acted(r, sim)})
    n = max((len(o["real_tpot_rounds_s"]) for o in out), default=1)
    print(f"{args.model} on {args.profile}: simulated against measured (" +
          ("one GPU round each)" if n == 1 else f"the median of {n} GPU rounds, their range beside it)"))
    print(f"{'mode':>18} {'budget':>6} {'real ms':>20} {'sim ms':>8} {'sim/real':>8} {'hit real':>8} {'hit sim':>8}"
          f"  acted (real / sim)")
    for o in out:
        real = spread({"tpot_s": o["real_tpot_s"], "tpot_rounds_s": o["real_tpot_rounds_s"]})
        print(f"{o['mode']:>18} {o['budget']:>6} {real:>20} {o['sim_tpot_s'] * 1e3:8.2f} "
              f"{o['ratio']:8.2f} {o['real_hit_rate']:8.1%} {o['sim_hit_rate']:8.1%}  {acts_in_words(o['acted'])}")
    if args.fit and profile.host_issue is not None:
        print(host_scale(args.fit, rows, profile, simulated))
    elif args.fit:
        print(fitted(args.fit, out, profile))
    within = sum(abs(o["ratio"] - 1) <= 0.15 for o in out)
    print(f"within 15%: {within} of {len(out)}; not modelled here: {', '.join(skipped) or 'none'}")
    differ = [f"{o['mode']} {o['budget']} ({acts_in_words(o['acted'], alone=True)})" for o in out if plans_differ(o["acted"])]
    if differ:  # (counted all the same: whether the plans ought to agree is the reader's to say, not this script's)
        print(f"two different plans (a mechanism acted in one run and not in the other): {'; '.join(differ)}")
    order = ranked(out, args.budget)
    print(said(order, args.budget, n == 1))
    (args.out / f"{args.model}.json").write_text(json.dumps({"profile": args.profile, "rows": out,
                                                             "skipped": skipped, "ranking": order},
                                                            indent=1, default=str))


def ranked(out: list[dict], budget: str) -> dict:
    """The modes at `budget` (the mechanisms side by side), simulated order against measured (runs.ranking)."""
    return ranking([(o["mode"], {"tpot_s": o["real_tpot_s"], "tpot_rounds_s": o["real_tpot_rounds_s"]},
                     o["sim_tpot_s"]) for o in out if o["budget"] == budget])


def said(order: dict, budget: str, single: bool) -> str:
    """The ranking in a few lines: the orders, and each pair the simulator swapped."""
    told, unresolved = len(order["alike"]) + len(order["swapped"]), len(order["unresolved"])
    line = f"ranking at {budget}: {len(order['alike'])} of the {told} pairs the rounds tell apart ordered alike"
    line += f" ({unresolved} more within the rounds' spread)" if unresolved else ""
    line += " (one round each: every pair taken as measured)" if single else ""
    line += f"\n  measured: {' < '.join(order['measured'])}\n  simulated: {' < '.join(order['simulated'])}"
    return line + "".join(f"\n  swapped: {a} measured faster than {b}" for a, b in order["swapped"])


def host_scale(row: str, rows: list[dict], profile, simulated) -> str:
    """The factor on the profile's host thread (host_issue) that brings row MODE:BUDGET's simulation to its
    measurement, by bisection (a slower host never makes a step shorter)."""
    import dataclasses

    mode, _, budget = row.partition(":")
    match = [r for r in rows if r["mode"] == mode and r["budget"] == budget and r["batch"] == 1
             and r.get("tier") == "host"]
    if not match:
        raise SystemExit(f"sim_check: no row {row} among the modelled ones")
    real = match[0]["tpot_s"]
    tpot = lambda k: simulated(match[0], dataclasses.replace(  # noqa: E731
        profile, host_issue=profile.host_issue.scaled(k)))["sim_tpot_s"]
    lo, hi = 0.0, 1.0
    while tpot(hi) < real and hi < 64:
        lo, hi = hi, hi * 2
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tpot(mid) < real else (lo, mid)
    k = (lo + hi) / 2
    return (f"fit {row}: the host thread's figures times {k:.3f} bring it to {real * 1e3:.2f} ms "
            f"(gpu_profile.py --host-scale: this factor times the one the profile was made with)")


def fitted(row: str, out: list[dict], profile) -> str:
    """The per_read_s that brings row MODE:BUDGET's simulation to its measurement: each load pays it once, so the
    gap over the simulated loads a token (first order: a load's time is on the step's path, as on-demand loads are)."""
    mode, _, budget = row.partition(":")
    match = [o for o in out if o["mode"] == mode and o["budget"] == budget]
    if not match:
        raise SystemExit(f"sim_check: no row {row} among the modelled ones")
    o, now = match[0], profile.tiers[0].per_read_s
    need = now + (o["real_tpot_s"] - o["sim_tpot_s"]) / o["sim_loads_per_token"]
    return (f"fit {row}: per_read_s {now * 1e3:.4f} ms -> {need * 1e3:.4f} ms "
            f"({o['sim_loads_per_token']:.1f} loads a token; gpu_profile.py --per-read-ms {need * 1e3:.4f})")


if __name__ == "__main__":
    main()
