"""`moetier calibrate` and `moetier sim`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moetier.atomic import atomic_write_json
from moetier.cache.policies import DEFAULT_POLICY, POLICIES, SUFFIX, check_policy
from moetier.cli.defaults import DEFAULT_MODEL, command, count, finite, make_folder, out_folder, write_plot
from moetier.errors import MoetierError


def _calibrate(args: argparse.Namespace) -> None:
    from moetier.calibrate import calibrate
    from moetier.resolve import resolve_model
    from moetier.sim.profile import HardwareProfile, user_profiles_dir
    from moetier.store.reader import check_reader_threads
    from moetier.store.store import Store

    check_reader_threads(args.reader_threads)
    profile = calibrate(Store(resolve_model(args.model, args.cache_dir)), args.name, args.reader_threads)
    path = Path(args.out) if args.out else user_profiles_dir() / f"{args.name}.json"
    if path.exists():  # keep what earlier runs measured for other shapes
        profile = profile.merged_with(HardwareProfile.load(path))
    profile.save(path)
    disk, cpu, m = profile.tiers[0], profile.device, profile.measured[0]
    print(f"wrote {path}\n  disk: {disk.bandwidth_bytes_per_s / 1e9:.2f} GB/s, {disk.per_read_s * 1e3:.3f} ms a request, "
          f"+ {disk.latency_s * 1e3:.3f} ms latency a lone read"
          f"\n  cpu: {cpu.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
          + ", ".join(f"{flop_rate(v)} {k}" for k, v in cpu.flops.items())
          + f", {cpu.call_overhead_s * 1e6:.1f} us per call"
          f"\n  {args.model}: expert {m.expert_s(1) * 1e3:.3f} ms at 1 token, {m.expert_s(8) * 1e3:.3f} ms at 8; "
          f"dense {m.dense_s_per_layer(1) * 1e3:.3f} ms per layer"
          f"\n  shapes measured: {len(profile.measured)} (`moetier calibrate --model M` adds one)")


def thrash_note(slots: int, per_token: int, hit_rate: float | None) -> str | None:
    """Why a cache smaller than one token's experts hits nothing: each layer's experts are evicted before that layer
    comes round again (a cycle longer than the cache, recency's worst case)."""
    if slots >= per_token or (hit_rate or 0) > 0.05:
        return None
    return (f"the cache holds {slots} experts and each token needs {per_token} (its layers' top-k): every expert is "
            f"evicted before its layer comes round again; a budget above one token's experts, or a policy that keeps "
            f"some (comoe, the default; lfu, static-hot), hits")


def flop_rate(flops: float) -> str:
    """A rate in the unit that shows it: a quantized expert's one-token rate is GFLOP/s (0.00 TFLOP/s said nothing)."""
    return f"{flops / 1e12:.2f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.1f} GFLOP/s"


def _sim(args: argparse.Namespace) -> None:
    """Every cell of the sweep is checked (budgets, policies, stages, trained files, the predictor) before any
    runs: a sweep is refused whole or runs whole."""
    from moetier.cache.policies import LEARNED, base_name
    from moetier.cli.generate import substitution_config
    from moetier.cli.models import model_shape, policy_dir, replay_predictor
    from moetier.plan.prefetchers import PREFETCHERS
    from moetier.policy_files import load_params
    from moetier.predictor_files import TRAINED
    from moetier.sim.cost import CostModel
    from moetier.sim.profile import HardwareProfile
    from moetier.sim.runner import make_runner
    from moetier.sim.sweep import (
        budget_slots,
        cache_split,
        check_fits,
        check_holds,
        encoder_set_aside,
        format_table,
        host_tier_slots,
        plot_sweep,
        run,
    )
    from moetier.sim.timing import plot_timeline
    from moetier.trace.batch import interleave
    from moetier.trace.format import Trace

    batches = [None] if args.batch is None else [_batch(b) for b in _items(args.batch, "--batch")]
    pressure = _pressure(args)
    speculation = _speculation(args, batches)
    if args.ray is not None:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise MoetierError("--ray needs Ray, an optional extra", hint="pip install 'moetier[ray]'")
    trace = Trace.load(args.trace)
    fitted = {base_name(p) for p in _items(args.policy, "--policy")} & set(LEARNED)
    trace = encoder_set_aside(trace, args.predictor in TRAINED or bool(fitted), lambda m: print(m, file=sys.stderr))
    profile = HardwareProfile.load(args.profile)
    model = args.model_shape or trace.model
    shape, blob_bytes = model_shape(model)  # config.json alone: nothing is converted or built for a shape
    check_fits(trace, shape)
    cost = CostModel.of(profile, shape, args.precision, blob_bytes)
    check_holds(cost)  # a model the profile's memory cannot hold at all is refused, not timed
    configs = [(p, b, f, n) for p in _items(args.policy, "--policy")
               for b in _items(args.expert_memory, "--expert-memory") for f in _items(args.prefetch, "--prefetch")
               for n in batches]
    for n in batches:
        if n is not None:
            interleave(trace, n)  # a trace that cannot be batched so is refused before any cell runs
    if args.host_memory is not None:
        host_tier_slots(args.host_memory, trace, cost)  # no disk tier, or no room for an expert: refused now
    for policy, budget, prefetch, _ in configs:
        check_policy(policy)
        if prefetch != "none" and prefetch not in PREFETCHERS:
            raise MoetierError(f"unknown prefetcher {prefetch!r}", hint=f"one of none, {', '.join(PREFETCHERS)}")
        # a budget the profile cannot hold, or one that leaves a layer of a split cache no slot: refused now
        cache_split(args.cache_partition, speculation is not None, budget_slots(budget, trace, cost), trace)
    if any(f != "none" for _, _, f, _ in configs) and args.predictor == "none":
        raise MoetierError("--prefetch needs a predictor", hint="give --predictor (oracle, hot, stacked-gates)")
    if any(p.endswith(SUFFIX) for p, *_ in configs) and args.predictor == "none":
        raise MoetierError(f"a {SUFFIX} policy needs a predictor", hint="give --predictor (oracle, hot, stacked-gates)")
    if len(configs) > 1:
        out_folder(args.out or "sim-sweep")
    if args.timeline and len(configs) > 1:
        raise MoetierError("--timeline draws one configuration", hint="give one policy, budget and prefetch stage")
    for n in batches:  # a step the (batched) trace never reaches, a budget the profile cannot hold: refused now
        if pressure is not None:
            pressure.resizes(interleave(trace, n) if n is not None else trace, cost, budget_slots)
    substitution = substitution_config(args)
    timeline_steps = (args.timeline_step,) if args.timeline else ()
    learned = sorted({base_name(p) for p, *_ in configs} & set(LEARNED))
    model_dir = policy_dir(model, args.cache_dir) if learned else None
    for name in learned:
        load_params(name, model_dir)  # a missing or damaged trained file, before any cell runs
    predictor = replay_predictor(args.predictor, trace, model, args.cache_dir, args.predict_distance,
                                 args.oracle_error)  # a fresh one per configuration, of the trace it replays

    def cell(config):  # one configuration; a closure the runner forks or ships with the trace and cost model
        policy, budget, prefetch, batch = config
        return run(trace, cost, policy, budget, args.preload, timeline_steps, args.cache_partition,
                   model_dir, prefetch, predictor, args.placement, substitution, batch, pressure, speculation,
                   args.host_memory)

    runner = make_runner(args.ray, args.workers if len(configs) > 1 else 1)
    with _progress(configs, runner.name) as bar:
        runs = runner.map(cell, configs, bar.update)
    where = f"{shape.name} ({cost.precision}) on {profile.name}"
    if len(runs) == 1:
        summary = dict(runs[0].row(), profile=profile.name, model_shape=shape.name, precision=cost.precision)
        if args.timeline:
            step, timeline = next(iter(runs[0].result.timelines.items()))
            title = f"{where}, {configs[0][0]}, {configs[0][1]}, prefetch {configs[0][2]}: step {step}"
            if write_plot(lambda path: plot_timeline(timeline, path, title), Path(args.timeline)):
                summary["timeline_plot"] = args.timeline
        print(json.dumps(summary, indent=1))
        note = thrash_note(summary["slots"], len(trace.layers) * trace.top_k, summary["hit_rate"])
        if note:
            print(f"note: {note}", file=sys.stderr)
        return
    out = make_folder(Path(args.out or "sim-sweep"))
    atomic_write_json(out / "sweep.json", {"profile": profile.name, "model_shape": shape.name,
                                           "precision": cost.precision, "trace": str(args.trace),
                                           "runs": [r.row() for r in runs]})
    print(f"{where}, trace {args.trace}\n{format_table(runs)}\nwrote {out / 'sweep.json'}", flush=True)
    if write_plot(lambda path: plot_sweep(runs, path, where), out / "sweep.png"):
        print(f"plot: {out / 'sweep.png'}")


def _doctor(args: argparse.Namespace) -> None:
    """A model (shape name, built-in, model folder or its config.json) is checked before any profile or calibration
    work."""
    from moetier.cli.models import config_shape, model_shape
    from moetier.sim.doctor import diagnose, format_plan, plot_plan
    from moetier.sim.profile import HardwareProfile, user_profiles_dir

    path = Path(args.model)
    if path.is_dir() and (path / "config.json").is_file() and not any(path.glob("*.safetensors")) \
            and not (path / "manifest.json").exists():
        path = path / "config.json"  # a folder of the config alone
    shape = config_shape(path) if path.name == "config.json" and path.is_file() else model_shape(args.model)[0]
    if args.precision:
        import dataclasses

        shape = dataclasses.replace(shape, precision=args.precision)
    kwargs = {}
    if args.fit:  # (a bad trace is refused before any calibration)
        from moetier.trace.format import Trace
        from moetier.trace.synthetic import fit_locality

        kwargs["locality"] = fit_locality(Trace.load(args.fit))
    if args.profile == "this-machine" and not (user_profiles_dir() / "this-machine.json").exists():
        print("moetier: no this-machine profile yet: calibrating first (`moetier calibrate`, about a minute)",
              file=sys.stderr)
        _calibrate(argparse.Namespace(model=DEFAULT_MODEL, name="this-machine", out=None, cache_dir=args.cache_dir,
                                      reader_threads=4))
    plan = diagnose(shape, HardwareProfile.load(args.profile), tokens=args.tokens, **kwargs)
    if args.json:
        print(json.dumps(plan, indent=1))
    else:
        print(format_plan(plan), flush=True)
    if args.plot and write_plot(lambda path: plot_plan(plan, path), Path(args.plot)) and not args.json:
        print(f"plot: {args.plot}")


def _speculation(args: argparse.Namespace, batches: list) -> tuple[int, float] | None:
    if args.speculate is None:
        if args.accept is not None:
            raise MoetierError("--accept is the drafts' acceptance under --speculate", hint="add --speculate K")
        return None
    if args.accept is None:
        raise MoetierError("--speculate replays verify steps whose drafts are kept with a probability the trace does "
                           "not hold", hint="give --accept (e.g. 0.6: a draft token kept 60% of the time)")
    if batches != [None]:
        raise MoetierError("--speculate replays one request at a time", hint="drop --batch")
    if not 1 <= args.speculate <= 16 or not 0 <= args.accept <= 1:
        raise MoetierError(f"--speculate takes 1..16 draft tokens and --accept a probability in [0, 1], got "
                           f"{args.speculate} and {args.accept}")
    return args.speculate, args.accept


def _pressure(args: argparse.Namespace):
    from moetier.sim.pressure import Pressure

    if args.pressure is None:
        if args.shrink is not None:
            raise MoetierError("--shrink chooses who leaves a cache that --pressure shrinks", hint="add --pressure")
        return None
    return Pressure.parse(args.pressure, args.shrink or "offload-priority")


def _batch(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 4096:
        raise MoetierError(f"--batch {text!r} is not a batch size", hint="whole numbers from 1, e.g. --batch 1,4,16")
    return int(text)


def _items(text: str, option: str) -> list[str]:
    """A comma-separated list of a sweep option, each item stripped; an empty item is refused."""
    items = [t.strip() for t in text.split(",")]
    if not all(items):
        raise MoetierError(f"{option} {text!r} has an empty item", hint=f"e.g. {option} a,b")
    return items


def _progress(configs: list, where: str):
    """A sweep of several cells shows a bar on stderr (each cell can take tens of seconds)."""
    from moetier.progress import tqdm

    return tqdm(total=len(configs), desc=f"sim ({where})", unit="cell", disable=len(configs) < 2, leave=False)


def add_parser(sub) -> None:
    from moetier.cli.generate import add_substitution_options
    from moetier.plan.placement import PLACEMENTS
    from moetier.predictor_names import BUILT_ON as PREDICTORS  # (the names alone: no torch to load for them)

    cal = command(sub, "calibrate", "measure this machine into the `this-machine` hardware profile")
    cal.add_argument("--model", default=DEFAULT_MODEL, help="the model whose expert shape to measure")
    cal.add_argument("--name", default="this-machine", help="the profile's name")
    cal.add_argument("--out", help="profile path (default: profiles/NAME.json in the cache directory, "
                                   "$MOETIER_CACHE or ~/.cache/moetier)")
    cal.add_argument("--cache-dir", help="where Hugging Face folders are converted")
    cal.add_argument("--reader-threads", type=int, default=4, help="threads reading experts from disk")
    cal.set_defaults(func=_calibrate)

    doc = command(sub, "doctor", "what a model will do on a machine, from its config alone: fits, least budget, "
                                 "simulated speed and memory per mode")
    doc.add_argument("model", help="a shape name (`moetier list shapes`), a built-in model, a model folder or its "
                                   "config.json (no weights needed)")
    doc.add_argument("--profile", default="this-machine",
                     help="a profile name (`moetier list profiles`) or JSON path; this-machine is calibrated first "
                          "if it has never been")
    doc.add_argument("--precision", help="the experts' precision (default: the checkpoint's)")
    doc.add_argument("--tokens", type=count(16, 100000), default=200, help="decode steps simulated per cell")
    doc.add_argument("--fit", metavar="TRACE", help="draw the routing with this trace's skew and locality (a recording "
                                                    "of the model itself; default: Qwen1.5-MoE's real routing)")
    doc.add_argument("--json", action="store_true", help="print the plan as JSON, for another program")
    doc.add_argument("--plot", help="PNG path: TPOT against memory, one line per mode")
    doc.add_argument("--cache-dir", help="where Hugging Face folders are converted (calibration's model)")
    doc.set_defaults(func=_doctor)

    sm = command(sub, "sim", "simulate a trace on a hardware profile, for one or a sweep of configurations",
                 description="Replays a routing trace through the engine's policy and planner objects and "
                             "times it on a hardware profile. Comma-separated policies or budgets sweep "
                             "every combination and write a table, JSON and a plot.")
    sm.add_argument("--trace", required=True, help="a trace folder")
    sm.add_argument("--profile", default="this-machine",
                    help="a profile name (`moetier list profiles`) or a JSON path")
    sm.add_argument("--model-shape", help="a shape name (`moetier list shapes`), a built-in model, or a model "
                                          "directory (default: the trace's model)")
    sm.add_argument("--precision", help="the experts' precision (default: the shape's checkpoint precision)")
    sm.add_argument("--policy", default=DEFAULT_POLICY, help=f"one or more of {', '.join(POLICIES)}, comma-separated; "
                    f"NAME{SUFFIX} spares what --predictor names for the coming layers")
    sm.add_argument("--expert-memory", default="30%", help="one or more budgets (bytes or %% of the experts)")
    sm.add_argument("--batch", help="one or more batch sizes, comma-separated: the trace's sequences interleaved into "
                                    "batches of N, a step routing the union of its tokens' experts (default: the "
                                    "trace's own steps, batch 1 unless it was recorded batched)")
    sm.add_argument("--cache-partition", default="auto", choices=["auto", "global", "per-layer"],
                    help="one expert cache for all layers, or the slots split evenly among them; auto: per-layer "
                         "where --speculate verifies drafts under a budget, else global (as the engine's)")
    sm.add_argument("--preload", action="store_true", help="start with the cache filled, as Engine.preload")
    sm.add_argument("--host-memory", help="a host tier behind the cache, as the GPU engine's --host-memory (bytes or "
                    "%% of the experts; least recently read out): a load it holds is a copy over the profile's first "
                    "tier, one it does not a read from its disk tier first (a profile with two tiers, e.g. "
                    "h200-pcie5); default: each expert in its profile tier")
    sm.add_argument("--prefetch", default="none",
                    help="one or more prefetch stages, comma-separated: none, hobbit, smoe, comoe, comoe-37, presched, ahead")
    sm.add_argument("--predictor", default="none",
                    choices=["none", *PREDICTORS],
                    help="oracle: the trace's own routing (a bound); hot: the trace's use counts; stacked-gates: the "
                         "model's routers on the trace's recorded gate inputs; llapor, comoe-mlp: trained networks")
    sm.add_argument("--predict-distance", type=count(1, 1024), default=2,
                    help="MoE layers ahead to predict (HOBBIT's p)")
    sm.add_argument("--oracle-error", type=finite(0, 1), default=0.0,
                    help="share of the oracle's (token, expert) pairs made wrong, drawn uniformly")
    sm.add_argument("--placement", default="none", choices=["none", *PLACEMENTS],
                    help="per missing expert, load it or compute it on the profile's host CPU: smoe-two-pointer (SMoE "
                         "Alg. 2), prescope (PreSched, cross-layer), greedy (layer by layer), hobbit-coop")
    add_substitution_options(sm)
    sm.add_argument("--pressure", metavar="STEP:BUDGET,...", help="memory pressure: before each STEP (forward steps "
                    "from 0) the expert budget becomes BUDGET (as --expert-memory), as --adapt resizes the engine's "
                    "cache when free memory changes; e.g. 100:10%%,300:40%%")
    sm.add_argument("--shrink", choices=["offload-priority", "policy"], help="who leaves a cache --pressure "
                    "shrinks: the experts of lowest CoMoE offload priority (Eq. 18; the default, as --adapt) or those "
                    "the eviction policy picks")
    sm.add_argument("--speculate", type=int, metavar="K", help="replay decode steps as --speculate K verifies them: "
                    "the last token and K drafts computed together, the step yielding the drafts kept and one more")
    sm.add_argument("--accept", type=float, metavar="P", help="with --speculate: each draft token kept with "
                    "probability P (the first rejection ends the step)")
    sm.add_argument("--cache-dir", help="where Hugging Face folders are converted")
    sm.add_argument("--timeline", help="PNG path: per-layer reads and compute of one step (single configuration)")
    sm.add_argument("--timeline-step", type=int, default=-1, help="which step (-1: the last)")
    sm.add_argument("--out", help="sweep output directory (default ./sim-sweep)")
    sm.add_argument("--workers", type=count(1, 1024),
                    help="a sweep's cells run in this many local processes (default: one per free core; 1: here)")
    sm.add_argument("--ray", metavar="ADDRESS",
                    help="run a sweep's cells as Ray tasks: auto (this machine's cluster), local (start one here) "
                         "or a cluster address; needs pip install 'moetier[ray]'")
    sm.set_defaults(func=_sim)
