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
    from moetier.sim.calibrate import calibrate
    from moetier.sim.replay import replay, steps
    from moetier.sim.timing import simulate
    from moetier.trace.record import TraceRecorder

    engine = Engine.from_pretrained(cfg["model"], expert_memory=cfg["budget"], policy=cfg["policy"], progress=False)
    profile = calibrate(engine.store)
    rng = random.Random(0)
    vocab = engine.spec.vocab_size
    warm, prompt = ([rng.randrange(vocab) for _ in range(cfg["prompt_len"])] for _ in range(2))
    preload = cfg["budget"] == "100%"
    if preload:
        engine.preload()
    with engine, TraceRecorder(engine) as recorder:
        engine.generate([warm], max_new_tokens=cfg["warmup_tokens"], ignore_eos=True)
        real = engine.generate([prompt], max_new_tokens=cfg["tokens"], ignore_eos=True).stats
        trace = recorder.trace(["warm-up", "measured"])
        slots = engine.executor.pool.num_slots
        expert_bytes = engine.executor.pool.slot_bytes
    replayed = replay(trace, make_policy(cfg["policy"]), slots, preload=preload)
    sim = simulate(trace, replayed, profile, expert_bytes)
    measured = [i for i, (phase, rows) in enumerate(steps(trace)) if phase == 1 and trace.seq[rows[0]] == 1]
    sim_tpot = float(np.mean([sim.step_time_s[i] for i in measured]))
    layers = len(trace.layers)
    plans = [p for i in measured for p in replayed.plans[i * layers:(i + 1) * layers]]
    sim_hit_rate = sum(len(p.hits) for p in plans) / sum(len(p.experts) for p in plans)
    return {"real_tpot_s": real["tpot_s"], "sim_tpot_s": sim_tpot, "ratio": sim_tpot / real["tpot_s"],
            "real_hit_rate": real["decode_hit_rate"], "sim_hit_rate": sim_hit_rate,
            "read_bandwidth": profile.link.bandwidth_bytes_per_s, "slots": slots}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(ap)
    ap.add_argument("--models", default=f"demo-fine,demo-coarse,{SYNTH}")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from tqdm import tqdm

    models = [m for m in args.models.split(",") if not m.startswith("/") or (Path(m) / "manifest.json").exists()]
    configs = [(m, b) for m in models for b in args.budgets.split(",")]
    rows = []
    for model, budget in tqdm(configs, desc="sim validation", unit="config"):
        cfg = dict(model=model, budget=budget, policy=args.policy, tokens=args.tokens,
                   warmup_tokens=args.warmup_tokens, prompt_len=args.prompt_len)
        rows.append(dict(model=Path(model).name, budget=budget, **run_child(__file__, cfg)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_validation.json").write_text(json.dumps(rows, indent=1))
    print(f"{'model':>20} {'budget':>6} {'real ms':>8} {'sim ms':>8} {'sim/real':>8} {'hit real':>8} {'hit sim':>8}")
    for r in rows:
        print(f"{r['model']:>20} {r['budget']:>6} {r['real_tpot_s'] * 1e3:8.1f} {r['sim_tpot_s'] * 1e3:8.1f} "
              f"{r['ratio']:8.2f} {r['real_hit_rate']:8.1%} {r['sim_hit_rate']:8.1%}")
    print(f"within 15%: {sum(abs(r['ratio'] - 1) <= 0.15 for r in rows)} of {len(rows)}")


if __name__ == "__main__":
    main()
