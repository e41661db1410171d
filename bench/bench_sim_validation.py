"""The simulator against the real engine on this machine, side by side in one run.

For each model and expert budget: the engine generates (a warm-up call, then a measured call) while its
routing is recorded; the simulator replays that trace with the same policy and budget through the same
residency/planner/policy objects, timed by a `this-machine` profile calibrated on that model in the same run.
Both TPOTs are over the measured call's decode steps. Target: within 15%.

    python bench/bench_sim_validation.py                 # demo-fine, demo-coarse, and the synthetic
                                                         # OLMoE-shaped store if bench_offload made it
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from common import add_run_options, run_child  # noqa: E402

SYNTH = Path.home() / ".cache" / "moetier" / "bench" / "olmoe-1b-7b-synth"


def child(cfg: dict) -> dict:
    import numpy as np

    from moetier import Engine
    from moetier.cache.policies import make_policy
    from moetier.resolve import resolve_model
    from moetier.sim.calibrate import calibrate, disk_tier
    from moetier.sim.cost import CostModel
    from moetier.sim.profile import Tier
    from moetier.sim.replay import replay, steps
    from moetier.sim.shapes import ModelShape
    from moetier.sim.timing import simulate
    from moetier.store.store import Store
    from moetier.trace.record import TraceRecorder

    # calibrate first: its resident run holds every expert, which must be released before the engine under test
    # takes its own budget
    store = Store(resolve_model(cfg["model"], progress=False))
    profile = calibrate(store, progress=False)
    gc.collect()
    engine = Engine.from_pretrained(cfg["model"], expert_memory=cfg["budget"], policy=cfg["policy"], progress=False)
    rng = random.Random(0)
    vocab = engine.spec.vocab_size
    warm, prompt = ([rng.randrange(vocab) for _ in range(cfg["prompt_len"])] for _ in range(2))
    preload = cfg["budget"] == "100%"
    if preload:
        engine.preload()
    with engine, TraceRecorder(engine) as recorder:
        engine.generate([warm], max_new_tokens=cfg["warmup_tokens"], ignore_eos=True)
        # the disk's speed drifts by tens of percent within minutes here: measure it just before and after
        before = disk_tier(store)
        real = engine.generate([prompt], max_new_tokens=cfg["tokens"], ignore_eos=True).stats
        after = disk_tier(store)
        trace = recorder.trace(["warm-up", "measured"])
        slots = engine.executor.pool.num_slots
        expert_bytes = engine.executor.pool.slot_bytes
    disk = Tier(before.name, (before.bandwidth_bytes_per_s + after.bandwidth_bytes_per_s) / 2,
                (before.latency_s + after.latency_s) / 2)
    profile = dataclasses.replace(profile, tiers=(disk,))
    replayed = replay(trace, make_policy(cfg["policy"]), slots, preload=preload)
    precision = engine.store.manifest.native_precision
    cost = CostModel.of(profile, ModelShape.from_spec(engine.spec, cfg["model"], precision), precision, expert_bytes)
    sim = simulate(trace, replayed, cost)
    measured = [i for i, (phase, rows) in enumerate(steps(trace)) if phase == 1 and trace.seq[rows[0]] == 1]
    sim_tpot = float(np.mean([sim.step_time_s[i] for i in measured]))
    layers = len(trace.layers)
    plans = [p for i in measured for p in replayed.plans[i * layers:(i + 1) * layers]]
    sim_hit_rate = sum(len(p.hits) for p in plans) / sum(len(p.experts) for p in plans)
    return {"real_tpot_s": real["tpot_s"], "sim_tpot_s": sim_tpot, "ratio": sim_tpot / real["tpot_s"],
            "real_hit_rate": real["decode_hit_rate"], "sim_hit_rate": sim_hit_rate,
            "read_bandwidth_before": before.bandwidth_bytes_per_s, "read_bandwidth_after": after.bandwidth_bytes_per_s,
            "read_latency_s": disk.latency_s, "slots": slots}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(ap)
    ap.add_argument("--models", default=f"demo-fine,demo-coarse,{SYNTH}")
    ap.add_argument("--rounds", type=int, default=3, help="measure every configuration this many times")
    ap.add_argument("--small-tokens", type=int, default=128,
                    help="measured tokens for the built-in demo models (a few ms each: more tokens, less noise)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from tqdm import tqdm

    models = [m for m in args.models.split(",") if not m.startswith("/") or (Path(m) / "manifest.json").exists()]
    configs = [(m, b) for m in models for b in args.budgets.split(",")]
    runs: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
    with tqdm(total=len(configs) * args.rounds, desc="sim validation", unit="run") as bar:
        for _ in range(args.rounds):  # round-robin, so drift over the run touches every configuration alike
            for model, budget in configs:
                tokens = args.tokens if model.startswith("/") else args.small_tokens
                cfg = dict(model=model, budget=budget, policy=args.policy, tokens=tokens,
                           warmup_tokens=args.warmup_tokens, prompt_len=args.prompt_len)
                runs[(model, budget)].append(run_child(__file__, cfg))
                bar.update()
    rows = [summarize(Path(model).name, budget, runs[(model, budget)]) for model, budget in configs]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_validation.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                              "rows": rows}, indent=1))
    print(f"{'model':>20} {'budget':>6} {'real ms':>8} {'sim ms':>8} {'sim/real':>8} {'range':>11} {'hit real':>8} "
          f"{'hit sim':>8} {'disk GB/s':>10}")
    for r in rows:
        print(f"{r['model']:>20} {r['budget']:>6} {r['real_tpot_s'] * 1e3:8.1f} {r['sim_tpot_s'] * 1e3:8.1f} "
              f"{r['ratio']:8.2f} {r['ratio_min']:5.2f}-{r['ratio_max']:<5.2f} {r['real_hit_rate']:8.1%} "
              f"{r['sim_hit_rate']:8.1%} {r['disk_gb_s']:10.2f}")
    print(f"within 15%: {sum(abs(r['ratio'] - 1) <= 0.15 for r in rows)} of {len(rows)}")


def summarize(model: str, budget: str, runs: list[dict]) -> dict:
    """Medians over the rounds; the ratio is of the medians, with the per-round range beside it."""
    import statistics

    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    ratios = [r["ratio"] for r in runs]
    return {"model": model, "budget": budget, "rounds": len(runs), "real_tpot_s": med("real_tpot_s"),
            "sim_tpot_s": med("sim_tpot_s"), "ratio": med("sim_tpot_s") / med("real_tpot_s"),
            "ratio_min": min(ratios), "ratio_max": max(ratios), "real_hit_rate": med("real_hit_rate"),
            "sim_hit_rate": med("sim_hit_rate"),
            "disk_gb_s": statistics.median(r[k] for r in runs for k in ("read_bandwidth_before",
                                                                          "read_bandwidth_after")) / 1e9,
            "runs": runs}


if __name__ == "__main__":
    main()
