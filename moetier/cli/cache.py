"""`moetier cache-bench` and `moetier train cache-policy`."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

from moetier.cache.policies import LEARNED
from moetier.cli.defaults import command, count, finite, write_plot
from moetier.errors import MoetierError


def _policies(spec: str, predicted: bool) -> list[str]:
    from moetier.cache.policies import SUFFIX
    from moetier.sim.cache_bench import all_policies

    names = all_policies(predicted) if spec == "all" else spec.split(",")
    unknown = sorted(set(names) - set(all_policies(True)))
    if unknown:
        raise MoetierError(f"unknown policies {unknown}", hint=f"choose from {', '.join(all_policies())} (each also "
                                                               f"as NAME{SUFFIX} with --predictor) or all")
    if not predicted and any(name.endswith(SUFFIX) for name in names):
        raise MoetierError(f"a {SUFFIX} policy needs a predictor", hint="give --predictor (e.g. stacked-gates)")
    wanted = set(names) | {"lru", "belady"}  # the gap closed is measured between them
    return [name for name in all_policies(True) if name in wanted]


def _cache_bench(args: argparse.Namespace) -> None:
    from moetier.atomic import atomic_write_json
    from moetier.cache.keys import ExpertKey
    from moetier.cli.models import model_shape, replay_predictor
    from moetier.progress import tqdm
    from moetier.sim.cache_bench import evaluate, format_table, plot, to_json
    from moetier.sim.cost import CostModel
    from moetier.sim.profile import HardwareProfile, ProfileError
    from moetier.sim.shapes import ShapeError
    from moetier.trace.format import Trace

    if not 0 < args.train_fraction < 1:
        raise MoetierError(f"--train-fraction must be in (0, 1), got {args.train_fraction}")
    policies, budgets = _policies(args.policy, args.predictor != "none"), args.expert_memory.split(",")
    partitions = ["global", "per-layer"] if args.cache_partition == "both" else [args.cache_partition]
    traces = [(path, Trace.load(path)) for path in args.trace]
    _check_budgets(budgets, traces)
    records = []
    with tqdm(total=len(traces) * len(budgets) * len(policies) * len(partitions), desc="cache-bench",
              unit="replay") as bar:
        for path, trace in traces:
            if trace.scores is None:
                tqdm.write(f"note: {path} has no full router scores: smoe-score sees top-k weights, zeros elsewhere")
            expert_bytes = read_s = None
            try:
                shape, blob_bytes = model_shape(trace.model)
                cost = CostModel.of(HardwareProfile.load(args.profile), shape, expert_bytes=blob_bytes)
                expert_bytes, read_s = cost.expert_bytes, cost.read_s(ExpertKey(trace.layers[0], 0))
            except (ShapeError, ProfileError) as e:
                tqdm.write(f"note: {path}: no bytes or miss penalty ({e})")
            # (hot counts the part the learned policies fit on, never the part scored)
            predictor = replay_predictor(args.predictor, trace, args.model or trace.model, None,
                                         args.predict_distance, fit_on=trace.split(args.train_fraction)[0])
            for partition in partitions:
                records += evaluate(trace, Path(path).name, budgets, policies, partition, args.train_fraction,
                                    expert_bytes, read_s, progress=bar.update, note=tqdm.write, predictor=predictor)
    print(format_table(records))
    if args.json:
        atomic_write_json(args.json, to_json(records))
        print(f"wrote {args.json}")
    if args.plot and write_plot(lambda path: plot(records, path), Path(args.plot)):
        print(f"plot: {args.plot}")


def _check_budgets(budgets: list[str], traces: list) -> None:
    """Every budget is read before any replay, and at least one must fit some trace (a budget too small for one
    trace's top-k is skipped there with a note)."""
    from moetier.sim.cache_bench import budget_slots, read_budget

    for budget in budgets:
        read_budget(budget)
    fits = 0
    for budget in budgets:
        for _, trace in traces:
            try:
                fits += bool(budget_slots(budget, trace))
            except MoetierError:
                pass
    if not fits:
        raise MoetierError(f"no budget in {','.join(budgets)} holds a layer's top-k experts of any trace",
                           hint="give larger budgets (a share like 25%, or a slot count of at least the top-k)")


def _train_cache_policy(args: argparse.Namespace) -> None:
    from moetier.policy_files import policy_file, save_params
    from moetier.sim.cache_bench import budget_slots
    from moetier.sim.fit import fit_hobbit, train_flashmoe, use_counts
    from moetier.trace.format import Trace

    trace = Trace.load(args.trace)
    out = trained_destination(args, trace, lambda folder: policy_file(folder, args.policy))
    if args.policy == "flashmoe-ml":
        model = train_flashmoe(trace, progress=True)
        save_params(args.policy, out, {"model": model}, model.trained_on)
    elif args.policy == "static-hot":
        save_params(args.policy, out, {"counts": use_counts(trace)}, trace.model)
    else:
        slots = budget_slots(args.expert_memory, trace)
        mixed, high, entry_bytes = _hobbit_run(args)
        weights, table = fit_hobbit(trace, slots, mixed=mixed, high=high, entry_bytes=entry_bytes)
        pair = mixed.pair(high) if mixed.mixed else (high,)
        save_params(args.policy, out, {"weights": weights}, trace.model, slots=slots, precision=args.precision,
                    pair=list(pair), thresholds=[mixed.t1, mixed.t2] if mixed.mixed else None,
                    grid=[[*dataclasses.astuple(w), penalty] for w, penalty in table])
        print(f"weights lru/lfu/lhu/fld = {weights.lru}/{weights.lfu}/{weights.lhu}/{weights.fld} "
              f"({' + '.join(pair)}{f', T1 {mixed.t1}, T2 {mixed.t2}' if mixed.mixed else ''})")
    print(f"wrote {out}")


def _hobbit_run(args: argparse.Namespace):
    """The run HOBBIT's weights are fitted for: its precision mode and pair, the model's own precision, one expert's
    bytes at each copy (the model's store: the sub-caches hold as many entries as its runs'; without --model, the
    copies' bit widths) and the model's fitted thresholds (the paper's without)."""
    from moetier.plan.precision import MixedPrecision
    from moetier.policy_files import load_thresholds
    from moetier.resolve import resolve_model
    from moetier.sim.replay import NATIVE
    from moetier.store.store import Store
    from moetier.store.variants import expert_layouts

    if args.precision != "hobbit":
        return MixedPrecision(), NATIVE, None
    mixed = MixedPrecision("hobbit", high=args.high_precision, low=args.low_precision)
    if args.model is None:
        return mixed.with_thresholds(), NATIVE, None
    store = Store(resolve_model(args.model, args.cache_dir, progress=False))
    high = store.manifest.native_precision
    mixed = mixed.with_thresholds(load_thresholds(model_dir(args.model, args.cache_dir)))
    copies = [p for p in dict.fromkeys(mixed.pair(high)) if p != high]
    entry_bytes = {high: store.native_layout.blob_bytes,
                   **{p: layout.blob_bytes for p, layout in expert_layouts(store.spec, copies).items()}}
    return mixed, high, entry_bytes


def _train_thresholds(args: argparse.Namespace) -> None:
    import numpy as np

    from moetier.plan.precision import HOBBIT_SHARES, fit_thresholds
    from moetier.policy_files import THRESHOLDS, policy_file, save_thresholds
    from moetier.trace.format import Trace

    trace = Trace.load(args.trace)
    out = trained_destination(args, trace, lambda folder: policy_file(folder, THRESHOLDS))
    t1, t2 = fit_thresholds(trace.topk_weights.astype(np.float32).reshape(-1, trace.top_k))
    save_thresholds(out, t1, t2, trace.model, shares=list(HOBBIT_SHARES), tokens=trace.num_tokens)
    print(f"T1 = {t1}, T2 = {t2} (loading {HOBBIT_SHARES[0]:.1%} of selected experts high, {HOBBIT_SHARES[1]:.1%} "
          f"low, skipping {HOBBIT_SHARES[2]:.1%}, as HOBBIT's 0.6 / 0.9 do on Mixtral-8x7B)")
    print(f"wrote {out}")


def check_trace_fits_model(trace, model: str, cache_dir: str | None) -> None:
    from moetier.resolve import resolve_model
    from moetier.store.store import Store

    spec = Store(resolve_model(model, cache_dir, progress=False)).spec
    if (trace.num_experts, trace.top_k) != (spec.num_experts, spec.top_k) or not set(trace.layers) <= set(
            spec.moe_layers):
        raise MoetierError(f"the trace ({trace.model}: top-{trace.top_k} of {trace.num_experts}, layers "
                           f"{trace.layers}) is not of {model} (top-{spec.top_k} of {spec.num_experts}, MoE layers "
                           f"{list(spec.moe_layers)})", hint="record a trace of this model with `moetier trace record`")


def trained_destination(args: argparse.Namespace, trace, file_in: Callable[[Path], Path]) -> Path:
    """Where `train` writes: --out, or the file `file_in(folder)` beside --model; checked first, before any work.
    The trace must be of --model wherever the file goes (a file trained on another model's routing fitted nothing
    it was given to); a model shipped with moetier (models/) is never written (its tracked files were)."""
    from moetier.resolve import shipped

    if args.out == "":  # (a path that names nothing: not "no --out", which saves beside --model)
        raise MoetierError("--out is empty", hint="give --out FILE, or leave it out to save beside --model")
    if args.model is None and args.out is None:
        raise MoetierError("give --model (a model folder the file is saved with) or --out FILE",
                           hint="a built-in model's own files are not written: copy its folder, or use --out")
    if args.model is not None:
        check_trace_fits_model(trace, args.model, args.cache_dir)
    out = Path(args.out) if args.out else file_in(model_dir(args.model, args.cache_dir))
    if shipped(out):
        raise MoetierError(f"{out} is a file of a model shipped with moetier, which is never written",
                           hint=f"give --out FILE, or copy {out.parents[1]} and train the copy (--model COPY)")
    return out


def model_dir(model: str, cache_dir: str | None) -> Path:
    from moetier.resolve import builtin_models, resolve_model

    return builtin_models().get(model) or resolve_model(model, cache_dir)


def add_parser(sub) -> None:
    from moetier.plan.precision import UNIFORM
    from moetier.predictor_names import BUILT_ON as PREDICTORS  # (the names alone: no torch to load for them)

    cb = command(sub, "cache-bench", "every eviction policy on routing traces, against the optimum")
    cb.add_argument("--trace", nargs="+", action="extend", required=True,
                    help="one or more trace folders (`--trace A B` or `--trace A --trace B`)")
    cb.add_argument("--expert-memory", default="10%,25%,50%", help="shares of the traced experts, or slot counts")
    cb.add_argument("--policy", default="all", help="comma-separated names (`moetier list policies`), or all")
    cb.add_argument("--cache-partition", default="global", choices=["global", "per-layer", "both"],
                    help="one cache shared by all layers, or the slots split evenly among them")
    cb.add_argument("--train-fraction", type=finite(0, 1), default=0.7,
                    help="learned policies fit on this first part; every policy is scored on the rest")
    cb.add_argument("--profile", default="this-machine",
                    help="hardware profile pricing a miss (the read of one expert) for the miss penalty")
    cb.add_argument("--json", help="write the records to this JSON file")
    cb.add_argument("--plot", help="write hit rate against budget per policy to this PNG")
    cb.add_argument("--predictor", default="none", choices=["none", *PREDICTORS],
                    help="every policy hears its predictions; `all` then adds each policy as NAME+predicted")
    cb.add_argument("--predict-distance", type=count(1, 1024), default=2, help="MoE layers ahead to predict")
    cb.add_argument("--model", help="the traces' model, for predictors built on its weights (default: the trace's)")
    cb.set_defaults(func=_cache_bench)

    tr = command(sub, "train", "train what moetier learns (cache policies, predictors)").add_subparsers(
        dest="train_command", required=True)
    cp = command(tr, "cache-policy", "fit a learned eviction policy on a trace and save it with the model")
    cp.add_argument("--policy", required=True, choices=LEARNED, help="the learned policy to fit")
    cp.add_argument("--trace", required=True, help="a trace of the model")
    cp.add_argument("--model", help="the model the trace is of, which the file is saved with (its policies/ folder; a "
                                    "built-in model's are not written: copy it first)")
    cp.add_argument("--out", help="write here instead")
    cp.add_argument("--expert-memory", default="25%", help="hobbit: the budget to fit the weights at")
    cp.add_argument("--precision", choices=["native", "hobbit"], default="hobbit",
                    help="hobbit: the cache to fit the weights for — HOBBIT's mixed one (default: the miss penalty "
                         "of Fig. 18a, a missed low copy costing B_l/B_h of a missed high one, on the run's own pair, "
                         "geometry and thresholds), or one precision (misses)")
    cp.add_argument("--low-precision", default="int4", choices=UNIFORM,
                    help="hobbit: the pair's low copy (int4 beside the model's own; int2 beside int8, as HOBBIT's "
                         "Jetson runs)")
    cp.add_argument("--high-precision", default="", choices=["", "int8", "q8_0"], metavar="{int8,q8_0}",
                    help="hobbit: the pair's high copy (default the model's own)")
    cp.add_argument("--cache-dir", help="where Hugging Face folders are converted")
    cp.set_defaults(func=_train_cache_policy)
    th = command(tr, "thresholds", "fit HOBBIT's importance thresholds T1, T2 to a model's routing and save them "
                                   "with the model: the shares of experts loaded high, low and skipped that the "
                                   "paper's 0.6 / 0.9 give on Mixtral-8x7B")
    th.add_argument("--trace", required=True, help="a trace of the model")
    th.add_argument("--model", help="the model the trace is of, which they are saved with (its policies/ folder; a "
                                    "built-in model's are not written: copy it first)")
    th.add_argument("--out", help="write here instead")
    th.add_argument("--cache-dir", help="where Hugging Face folders are converted")
    th.set_defaults(func=_train_thresholds)
    from moetier.cli.merge import add_train_parser as add_train_similarity
    from moetier.cli.predict import add_train_parser

    add_train_parser(tr)
    add_train_similarity(tr)
