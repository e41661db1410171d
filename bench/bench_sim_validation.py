"""The simulator against the real engine on this machine, side by side in one run.

For each model and expert budget: the engine generates (a warm-up call, then a measured call) while its
routing is recorded; the simulator replays that trace with the same policy and budget through the same
layer step (residency, planner, policy objects), on a `this-machine` profile calibrated on that model in the same
run.
Both TPOTs are over the measured call's decode steps. Target: within 15%.

With `--prefetch CONFIG,...` each configuration runs too (`none` is always there): `STAGE:PREDICTOR` a prefetch
stage (the engine records the router inputs, and the simulator replays them through the same predictor and
stage), `precision:MODE` a precision mode (hobbit, low-tier, int4, ...), `substitute:ALPHA` SMoE's substitution;
the simulator must rank the configurations as the engine does (issues 13 and 32). Each run's own profile measures the disk
around that run, and this disk drifts between runs: so every run is also replayed on one profile per model and
budget (the median disk over its runs; the traces and profiles are kept under OUT/runs/), and both rankings are
printed, each also held only to the orders the engine itself resolves (pairs whose rounds do not overlap). Beside
each row, diagnostics: the engine's reader bandwidth against the disk measured beside it, and the measured call's
expert kernels as the simulator prices them over what the engine's executor clocked.

    python bench/bench_sim_validation.py                 # demo-fine, demo-coarse, and the synthetic
                                                         # OLMoE-shaped store if bench_offload made it
    python bench/bench_sim_validation.py --models demo-deep-xl,demo-fine-xl --budgets 25%,50% \
        --prefetch hobbit:stacked-gates,smoe:stacked-gates --out bench/out/sim-prefetch-validation
    python bench/bench_sim_validation.py --models demo-deep-xl,demo-fine-xl --budgets 25%,50% --rounds 2 \
        --small-tokens 96 --prefetch hobbit:stacked-gates,precision:hobbit,substitute:0.35 \
        --out bench/out/sim-mechanisms-validation
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

from moetier.paths import default_cache_dir  # noqa: E402

SYNTH = default_cache_dir() / "bench" / "olmoe-1b-7b-synth"


def mechanisms(config: str) -> dict:
    """A configuration's engine options: prefetch stage and predictor, precision mode, substitution, and (where
    the configuration names one) a placement."""
    from moetier.plan.precision import MixedPrecision
    from moetier.plan.substitute import Substitution

    kind, _, value = config.partition(":")
    if kind == "precision":
        return dict(prefetch="none", predictor="none", precision=MixedPrecision(value), substitution=None)
    if kind == "substitute":
        return dict(prefetch="none", predictor="none", precision=MixedPrecision(),
                    substitution=Substitution(alpha=float(value)))
    if kind == "placement":  # the CPU lane beside a GPU (moetier.plan.placement)
        return dict(prefetch="none", predictor="none", precision=MixedPrecision(), substitution=None,
                    placement=value)
    return dict(prefetch=kind, predictor=value or "none", precision=MixedPrecision(), substitution=None)


def calibrated(model: str):
    """`moetier calibrate` in a process of its own, as a user runs it before the engine: in one process with the
    engine under test (its resident engines' memory freed just before) that engine decoded ~10% slower here, and
    its rounds scattered by up to 1.9x."""
    import subprocess
    import tempfile

    from moetier.sim.profile import HardwareProfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        subprocess.run([sys.executable, "-m", "moetier.cli", "calibrate", "--model", model, "--out", str(out)],
                       check=True, capture_output=True)
        return HardwareProfile.load(out)


def child(cfg: dict) -> dict:
    from moetier import Engine
    from moetier.calibrate import disk_tier
    from moetier.resolve import resolve_model
    from moetier.store.store import Store
    from moetier.trace.record import TraceRecorder

    # Calibrate before and after the engine under test (never beside it: the resident run of calibration holds
    # every expert) and average, so slow drift of this shared machine touches both sides alike.
    store = Store(resolve_model(cfg["model"], progress=False))
    first = calibrated(cfg["model"])
    m = mechanisms(cfg.get("prefetch", "none"))
    stage = m["prefetch"]
    engine = Engine.from_pretrained(cfg["model"], expert_memory=cfg["budget"], policy=cfg["policy"], progress=False,
                                    prefetch=stage, predictor=m["predictor"], precision=m["precision"],
                                    substitution=m["substitution"])
    rng = random.Random(0)
    vocab = engine.spec.vocab_size
    warm, prompt = ([rng.randrange(vocab) for _ in range(cfg["prompt_len"])] for _ in range(2))
    preload = cfg["budget"] == "100%"
    if preload:
        engine.preload()
    with engine, TraceRecorder(engine, gate_inputs=stage != "none") as recorder:
        engine.generate([warm], max_new_tokens=cfg["warmup_tokens"], ignore_eos=True)
        # the disk's speed drifts by tens of percent within minutes here: measure it just before and after
        before = disk_tier(store)
        busy, nbytes = engine.executor.reader.activity()
        computed = engine.executor.costs.expert_s_total
        real = engine.generate([prompt], max_new_tokens=cfg["tokens"], ignore_eos=True).stats
        busy, nbytes = (b - a for a, b in zip((busy, nbytes), engine.executor.reader.activity()))
        computed = engine.executor.costs.expert_s_total - computed  # its experts' kernels, by the executor's clock
        after = disk_tier(store)
        trace = recorder.trace(["warm-up", "measured"])
        slots = engine.executor.residency.capacity_bytes // engine.executor.pool.slot_bytes  # at the high precision
        expert_bytes = engine.executor.pool.slot_bytes
        entry_bytes = {p: pool.slot_bytes for p, pool in engine.executor.pools.items()}
        distance = engine.config.predict_distance
        # the precision mode as the engine resolved it: the model's fitted HOBBIT thresholds (policies/thresholds.json:
        # 0.84 / 0.98 on demo-fine-xl, where the paper's 0.6 / 0.9 skip and load low far more), the low copy chosen
        mixed = dataclasses.asdict(engine.precision)
    del engine, recorder
    gc.collect()
    profile = average(first, calibrated(cfg["model"]))
    disk = dataclasses.replace(before, bandwidth_bytes_per_s=(before.bandwidth_bytes_per_s +
                                                              after.bandwidth_bytes_per_s) / 2,
                               latency_s=(before.latency_s + after.latency_s) / 2,
                               cpu_s_per_byte=(before.cpu_s_per_byte + after.cpu_s_per_byte) / 2,
                               per_read_s=(before.per_read_s + after.per_read_s) / 2)
    profile = dataclasses.replace(profile, tiers=(disk,))
    run = dict(slots=slots, expert_bytes=expert_bytes, distance=distance, preload=preload, entry_bytes=entry_bytes,
               mixed=mixed)
    if cfg.get("keep"):  # for the replay of every configuration on one profile (main)
        keep = Path(cfg["keep"])
        trace.save(keep / "trace", overwrite=True)
        profile.save(keep / "profile.json")
        (keep / "run.json").write_text(json.dumps(run))
    sim = replay(trace, profile, cfg, **run)
    return sim | {"real_tpot_s": real["tpot_s"], "ratio": sim["sim_tpot_s"] / real["tpot_s"],
                  "real_prefetches": real["prefetches"], "real_hit_rate": real["decode_hit_rate"],
                  "read_bandwidth_before": before.bandwidth_bytes_per_s,
                  "read_bandwidth_after": after.bandwidth_bytes_per_s, "read_latency_s": disk.latency_s,
                  "read_cpu_s_per_mib": disk.cpu_s_per_byte * 2**20, "slots": slots,
                  # what the engine's reader moved while at least one read ran, for comparison with the disk above:
                  # a diagnostic, not an input of the simulator
                  "engine_read_bandwidth": nbytes / busy if busy > 0 else None,
                  # the measured call's experts computed, engine and simulator: where a miss lies, in the kernels'
                  # prices or around them (a diagnostic)
                  "engine_expert_s": computed}


def replay(trace, profile, cfg: dict, slots: int, expert_bytes: int, distance: int, preload: bool,
           entry_bytes: dict | None = None, mixed: dict | None = None) -> dict:
    """The simulator on one run's trace: TPOT over the measured call's decode steps, hit rate, prefetches. `mixed`:
    the engine's precision mode as it resolved it (thresholds, low copy); by default the configuration's own."""
    import numpy as np

    from moetier.cache.policies import PolicyContext
    from moetier.cli.models import replay_predictor
    from moetier.plan.counters import PhaseCounters, prefetch_summary
    from moetier.plan.layer_plan import FAST
    from moetier.resolve import resolve_model
    from moetier.sim.cost import CostModel
    from moetier.sim.replay import simulate, steps, trace_policy
    from moetier.sim.shapes import ModelShape
    from moetier.store.store import Store

    store = Store(resolve_model(cfg["model"], progress=False))
    m = mechanisms(cfg.get("prefetch", "none"))
    stage, predictor = m["prefetch"], m["predictor"]
    if mixed is not None:
        from moetier.plan.precision import MixedPrecision

        m["precision"] = MixedPrecision(**mixed)
    precision = store.manifest.native_precision
    cost = CostModel.of(profile, ModelShape.from_spec(store.spec, cfg["model"], precision), precision, expert_bytes)
    made = None
    if stage != "none":  # the same predictor, built for the trace as `moetier sim` builds it
        made = replay_predictor(predictor, trace, cfg["model"], None, distance)(trace)
    call = [(i, phase) for i, (phase, rows) in enumerate(steps(trace)) if trace.seq[rows[0]] == 1]  # measured call
    # (the policy as `moetier sim` builds it: a context, and a learned one's parameters from beside the model)
    policy = trace_policy(cfg["policy"], PolicyContext(slots, tuple(trace.all_layers), trace.num_experts,
                                                       trace.top_k), trace, store.path)
    sim = simulate(trace, policy, slots, cost, precision, preload=preload, keep_plans=True,
                   prefetch=stage, predictor=made, mixed=m["precision"], substitution=m["substitution"],
                   placement=m.get("placement", "none"), timeline_steps=tuple(i for i, _ in call))
    measured = [i for i, phase in call if phase == 1]  # its decode steps
    layers = len(trace.layers)
    plans = [p for i in measured for p in sim.plans[i * layers:(i + 1) * layers]]
    # prefetches over the measured call, prefill and decode, as the engine's stats count them (not the warm-up's)
    counted, decode = PhaseCounters(), PhaseCounters()
    for plan in (p for i, _ in call for p in sim.plans[i * layers:(i + 1) * layers]):
        counted.add(plan, entry_bytes or {precision: expert_bytes})
    for plan in plans:  # what the mechanisms did over the decode steps, as a row's `host_runs` and `substituted`
        decode.add(plan, entry_bytes or {precision: expert_bytes})
    return {"sim_tpot_s": float(np.mean([sim.step_time_s[i] for i in measured])),
            "sim_hit_rate": sum(len(p.hits) for p in plans) / sum(len(p.experts) for p in plans),
            "sim_loads_per_token": sum(len(p.loads) for p in plans) / len(measured),
            "sim_prefetches": prefetch_summary([counted]),
            "sim_host_runs": decode.host_runs, "sim_substituted": decode.substituted,
            "sim_expert_s": sum(end - start for tls in sim.timelines.values() for tl in tls  # (the engine's clock
                                for _, start, end, place in tl.computes if place == FAST)}  # is on these only)


def common_profile(dirs: list[Path]):
    """One profile for every run of a model and budget: the first run's compute figures, the disk's median
    bandwidth, latency, CPU per byte and cost per request over all runs (as a user simulating this machine would have one)."""
    import statistics

    from moetier.sim.profile import HardwareProfile

    profiles = [HardwareProfile.load(d / "profile.json") for d in dirs]
    med = lambda f: statistics.median(f(p.tiers[0]) for p in profiles)  # noqa: E731
    disk = dataclasses.replace(profiles[0].tiers[0], bandwidth_bytes_per_s=med(lambda t: t.bandwidth_bytes_per_s),
                               latency_s=med(lambda t: t.latency_s), cpu_s_per_byte=med(lambda t: t.cpu_s_per_byte),
                               per_read_s=med(lambda t: t.per_read_s))
    return dataclasses.replace(profiles[0], tiers=(disk,))


def replay_on_common(runs: dict, configs: list) -> None:
    """Each configuration's runs again in the simulator, all on their model and budget's common profile: the
    ranking the simulator gives free of the disk's drift between runs (each run's own profile measured it)."""
    from moetier.trace.format import Trace

    for model, budget in dict.fromkeys((m, b) for m, b, _ in configs):
        mine = [c for c in configs if c[:2] == (model, budget)]
        profile = common_profile([Path(r["keep"]) for c in mine for r in runs[c]])
        for c in mine:
            for r in runs[c]:
                d = Path(r["keep"])
                cfg = dict(model=model, budget=budget, policy=r["policy"], prefetch=c[2])
                r["common_sim_tpot_s"] = replay(Trace.load(d / "trace"), profile, cfg,
                                                **json.loads((d / "run.json").read_text()))["sim_tpot_s"]


def average(a, b):
    """Two calibrations of the same shape, their compute figures averaged."""
    from moetier.sim.profile import mean_curve as mean

    later = {m.precision: m for m in b.measured}
    measured = tuple(dataclasses.replace(ma, expert_s=mean(ma.expert_s, mb.expert_s),
                                         dense_s_per_layer=mean(ma.dense_s_per_layer, mb.dense_s_per_layer),
                                         head_s=mean(ma.head_s, mb.head_s))
                     for ma in a.measured for mb in [later.get(ma.precision, ma)])  # (each precision measured)
    return dataclasses.replace(a, measured=measured,
                               executor_s_per_layer=mean(a.executor_s_per_layer, b.executor_s_per_layer))


def prepare(models: list[str], configs: list[str]) -> None:
    """The quantized copies a precision configuration needs, added to the cached stores before anything is timed
    (so calibration measures them in every run, and no run pays for quantizing)."""
    from moetier.engine.engine import add_missing_precisions
    from moetier.resolve import resolve_model
    from moetier.store.store import Store

    for config in configs:
        mixed = mechanisms(config)["precision"]
        for model in models:
            add_missing_precisions(Store(resolve_model(model, progress=False)), mixed, progress=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(ap)
    ap.add_argument("--models", default=f"demo-fine,demo-coarse,{SYNTH}")
    ap.add_argument("--rounds", type=int, default=3, help="measure every configuration this many times")
    ap.add_argument("--small-tokens", type=int, default=256,
                    help="measured tokens for the built-in demo models (a few ms each: more tokens, less noise)")
    ap.add_argument("--prefetch", default="", help="STAGE:PREDICTOR configurations beside none, comma-separated "
                                                   "(predictors a trace can drive: stacked-gates, llapor, ...)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from moetier.progress import tqdm

    models = [m for m in args.models.split(",") if not m.startswith("/") or (Path(m) / "manifest.json").exists()]
    prefetches = ["none", *filter(None, args.prefetch.split(","))]
    configs = [(m, b, f) for m in models for b in args.budgets.split(",") for f in prefetches]
    prepare(models, prefetches)
    runs: dict[tuple[str, str, str], list[dict]] = {c: [] for c in configs}
    with tqdm(total=len(configs) * args.rounds, desc="sim validation", unit="run") as bar:
        for _ in range(args.rounds):  # round-robin, so drift over the run touches every configuration alike
            for model, budget, prefetch in configs:
                tokens = args.tokens if model.startswith("/") else args.small_tokens
                keep = args.out / "runs" / f"{Path(model).name}-{budget}-{prefetch}-{len(runs[(model, budget, prefetch)])}"
                cfg = dict(model=model, budget=budget, policy=args.policy, tokens=tokens, keep=str(keep),
                           warmup_tokens=args.warmup_tokens, prompt_len=args.prompt_len, prefetch=prefetch)
                runs[(model, budget, prefetch)].append(run_child(__file__, cfg) | {"keep": str(keep),
                                                                                    "policy": args.policy})
                bar.update()
    if len(prefetches) > 1:
        replay_on_common(runs, configs)
    rows = [summarize(Path(model).name, budget, runs[c]) | {"prefetch": prefetch}
            for c in configs for model, budget, prefetch in [c]]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_validation.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                              "rows": rows}, indent=1))
    print(f"{'model':>20} {'budget':>6} {'prefetch':>22} {'real ms':>8} {'sim ms':>8} {'sim/real':>8} {'range':>11} "
          f"{'hit real':>8} {'hit sim':>8} {'disk GB/s':>10} {'in engine':>10} {'experts':>8}")
    for r in rows:
        print(f"{r['model']:>20} {r['budget']:>6} {r['prefetch']:>22} {r['real_tpot_s'] * 1e3:8.1f} "
              f"{r['sim_tpot_s'] * 1e3:8.1f} "
              f"{r['ratio']:8.2f} {r['ratio_min']:5.2f}-{r['ratio_max']:<5.2f} {r['real_hit_rate']:8.1%} "
              f"{r['sim_hit_rate']:8.1%} {r['disk_gb_s']:10.2f} {r['engine_read_gb_s']:10.2f} {r['expert_ratio'] or 0:8.2f}")
    print(f"within 15%: {sum(abs(r['ratio'] - 1) <= 0.15 for r in rows)} of {len(rows)}")
    if len(prefetches) > 1:
        print(ranking(rows))
        print("every run replayed on its model and budget's one profile (median disk over the runs):")
        for r in rows:
            print(f"{r['model']:>20} {r['budget']:>6} {r['prefetch']:>22} real {r['real_tpot_s'] * 1e3:7.1f} "
                  f"sim {r['common_sim_tpot_s'] * 1e3:7.1f} ({r['common_sim_tpot_s'] / r['real_tpot_s']:.2f})")
        print(ranking(rows, "common_sim_tpot_s"))
    plot(rows, args.out / "sim_validation.png")
    print(f"plot: {args.out / 'sim_validation.png'}")


def plot(rows: list[dict], path: Path) -> None:
    """Simulated against real TPOT per configuration, with the per-round range, on log axes with y = x and the
    15% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5.5))
    lo = min(min(r["real_tpot_s"], r["sim_tpot_s"]) for r in rows) * 1e3 / 1.5
    hi = max(max(r["real_tpot_s"], r["sim_tpot_s"]) for r in rows) * 1e3 * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", lw=1)
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="0.9", label="within 15%")
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        real = [r["real_tpot_s"] * 1e3 for r in mine]
        sim = [r["sim_tpot_s"] * 1e3 for r in mine]
        err = [[max(0.0, s - r["ratio_min"] * x) for s, x, r in zip(sim, real, mine)],  # (one round: 0, or -1e-17)
               [max(0.0, r["ratio_max"] * x - s) for s, x, r in zip(sim, real, mine)]]
        line = ax.errorbar(real, sim, yerr=err, fmt="o", capsize=3, label=model)
        if "common_sim_tpot_s" in mine[0]:  # the same runs on one profile per model and budget
            ax.scatter(real, [r["common_sim_tpot_s"] * 1e3 for r in mine], facecolors="none",
                       edgecolors=line[0].get_color(), s=80, label=f"{model}, one profile")
        for x, y, r in zip(real, sim, mine):
            label = r["budget"] if r.get("prefetch", "none") == "none" else f"{r['budget']} {r['prefetch']}"
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, -10), fontsize=7)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="real TPOT, ms (median of rounds)",
           ylabel="simulated TPOT, ms", title="simulator against the engine on this machine (LRU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ranking(rows: list[dict], sim_key: str = "sim_tpot_s") -> str:
    """Per model and budget, the prefetch configurations fastest first, by the engine and by the simulator
    (`sim_key`: each run on its own profile, or common_sim_tpot_s: all on one); then the same held only to the
    orders the engine itself resolves (`resolved`)."""
    lines, agree, held, groups = [], 0, 0, list(dict.fromkeys((r["model"], r["budget"]) for r in rows))
    for model, budget in groups:
        mine = [r for r in rows if (r["model"], r["budget"]) == (model, budget)]
        real = [r["prefetch"] for r in sorted(mine, key=lambda r: r["real_tpot_s"])]
        sim = [r["prefetch"] for r in sorted(mine, key=lambda r: r[sim_key])]
        agree += real == sim
        pairs = resolved(mine)
        kept = [(a, b) for a, b in pairs if a[sim_key] < b[sim_key]]
        held += len(kept) == len(pairs)
        lines.append(f"{model} {budget}: engine {' < '.join(real)} | simulator {' < '.join(sim)} | the engine "
                     f"resolves {len(pairs)} of {len(mine) * (len(mine) - 1) // 2} pairs, the simulator orders "
                     f"{len(kept)} of them alike" + "".join(f"; not {a['prefetch']} < {b['prefetch']}"
                                                           for a, b in pairs if (a, b) not in kept))
    return "\n".join(lines + [f"same ranking ({sim_key}): {agree} of {len(groups)}; every order the engine resolves "
                              f"kept: {held} of {len(groups)}"])


def resolved(rows: list[dict]) -> list[tuple[dict, dict]]:
    """The pairs (a, b) of one model and budget that the engine orders in every round: a's slowest round faster than
    b's fastest. With three rounds each, no overlap is the exact one-sided Mann-Whitney test at p = 1/20; pairs whose
    rounds overlap, the engine does not rank (its order of them moved between runs of this benchmark), so a
    simulator is not held to one."""
    tpots = [[run["real_tpot_s"] for run in r["runs"]] for r in rows]
    return [(rows[i], rows[j]) if max(tpots[i]) < min(tpots[j]) else (rows[j], rows[i])
            for i in range(len(rows)) for j in range(i + 1, len(rows))
            if max(tpots[i]) < min(tpots[j]) or max(tpots[j]) < min(tpots[i])]


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
            "engine_read_gb_s": statistics.median(r.get("engine_read_bandwidth") or 0.0 for r in runs) / 1e9,
            "expert_ratio": med("sim_expert_s") / med("engine_expert_s") if runs[0].get("engine_expert_s") else None,
            "runs": runs} | ({"common_sim_tpot_s": med("common_sim_tpot_s")} if "common_sim_tpot_s" in runs[0] else {})


if __name__ == "__main__":
    main()
