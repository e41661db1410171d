"""`moetier predict-bench` and `moetier train predictor`."""

from __future__ import annotations

import argparse
from pathlib import Path

from moetier.cli.defaults import command, count, finite, make_folder, out_folder, write_plot
from moetier.errors import MoetierError

BENCHED = ("stacked-gates", "llapor", "comoe-mlp", "hot")  # unless told (the oracle scores 100% by construction)


def _predict_bench(args: argparse.Namespace) -> None:
    from moetier.atomic import atomic_write_json
    from moetier.cli.models import policy_dir, routers
    from moetier.predict import PREDICTORS
    from moetier.predictor_files import TRAINED, load_nets
    from moetier.sim.predict_bench import format_table, plot, predict_bench, to_json
    from moetier.sim.predictors import check_replayable, trace_counts, trace_predictor

    out_folder(args.out)
    from moetier.trace.format import Trace

    if not 0 < args.train_fraction < 1:
        raise MoetierError(f"--train-fraction must be in (0, 1), got {args.train_fraction}")
    names = args.predictor.split(",")
    unknown = sorted(set(names) - set(PREDICTORS))
    if unknown:
        raise MoetierError(f"unknown predictors {unknown}", hint=f"choose from {', '.join(PREDICTORS)}")
    for name in names:
        check_replayable(name)
    traces = {path: Trace.load(path) for path in args.trace}
    weights: dict[str, dict | None] = {}
    folders: dict[str, Path | None] = {}
    for path, trace in traces.items():
        model = args.model or trace.model
        on_weights = [n for n in names if n in ("stacked-gates", *TRAINED)]
        if on_weights:
            if trace.gate_inputs is None:
                raise MoetierError(f"{path} has no gate inputs, which {on_weights[0]} predicts from",
                                   hint="record it with `moetier trace record --gate-inputs`")
            if not model:
                raise MoetierError(f"{path} does not name its model", hint="give --model")
            weights[path], folders[path] = routers(model, args.cache_dir), policy_dir(model, args.cache_dir, "predictors")
            if weights[path] is None:
                raise MoetierError(f"{on_weights[0]} needs the weights of {model!r}, a shape without them",
                                   hint="give --model with a built-in model or a model directory")
            for name in set(on_weights) & set(TRAINED):
                load_nets(name, folders[path])  # refuse before any work if one is not trained

    def maker(name: str, path: str):
        def make(train: Trace, whole: Trace):
            counts = trace_counts(train) if name == "hot" else None  # fitted on the first part only
            nets = load_nets(name, folders[path]) if name in TRAINED else None  # fresh: llapor learns online
            return trace_predictor(name, whole, args.distance, weights.get(path), counts, nets=nets)
        return make

    records = []
    for path, trace in traces.items():
        records += predict_bench({path: trace}, {name: maker(name, path) for name in names}, args.train_fraction)
    print(format_table(records))
    out = make_folder(Path(args.out))
    atomic_write_json(out / "predict-bench.json", to_json(records))
    print(f"wrote {out / 'predict-bench.json'}")
    if write_plot(lambda path: plot(records, path), out / "predict-bench.png"):
        print(f"plot: {out / 'predict-bench.png'}")


def add_parser(sub) -> None:
    pb = command(sub, "predict-bench", "expert predictors on recorded traces: recall per layer distance")
    pb.add_argument("--trace", nargs="+", action="extend", required=True,
                    help="trace folders recorded with --gate-inputs (`moetier trace record`)")
    pb.add_argument("--predictor", default=",".join(BENCHED), help="comma-separated (`moetier list predictors`)")
    pb.add_argument("--model", help="the traces' model, for predictors built on its weights (default: the trace's)")
    pb.add_argument("--distance", type=count(1, 1024), default=3, help="MoE layers ahead to score (1..N)")
    pb.add_argument("--train-fraction", type=finite(0, 1), default=0.3,
                    help="share of each trace that predictors which learn learn from; the rest is scored")
    pb.add_argument("--cache-dir", help="where Hugging Face folders are converted")
    pb.add_argument("--out", default="predict-bench", help="folder for the JSON and the plot")
    pb.set_defaults(func=_predict_bench)


def _train_predictor(args: argparse.Namespace) -> None:
    import numpy as np

    from moetier.cli.cache import trained_destination
    from moetier.predictor_files import predictor_file, save_nets, train_nets
    from moetier.progress import tqdm
    from moetier.trace.format import Trace

    traces = [Trace.load(path) for path in args.trace]
    for path, trace in zip(args.trace, traces):
        if trace.gate_inputs is None:
            raise MoetierError(f"{path} has no gate inputs, which {args.predictor} learns from",
                               hint="record it with `moetier trace record --gate-inputs`")
        if trace.layers != traces[0].layers:
            raise MoetierError(f"{path} covers other layers than {args.trace[0]}", hint="give traces of one model")
        out = trained_destination(args, trace, lambda folder: predictor_file(folder, args.predictor))
    first = traces[0]
    cat = lambda name: np.concatenate([getattr(t, name) for t in traces])  # noqa: E731
    seq = np.concatenate([t.seq + i * (1 << 20) for i, t in enumerate(traces)])  # sequences of different traces differ
    with tqdm(total=len(first.layers) - 1, desc=f"train {args.predictor}", unit="layer") as bar:
        nets = train_nets(args.predictor, cat("gate_inputs"), cat("topk_ids"), cat("topk_weights"), seq, first.layers,
                          first.num_experts, args.epochs, bar.update)
    save_nets(args.predictor, out, nets, {"hidden": int(first.gate_inputs.shape[-1]), "num_experts": first.num_experts,
                                          "layers": first.layers, "epochs": args.epochs,
                                          "trained_on": [str(p) for p in args.trace],
                                          "tokens": int(sum(t.num_tokens for t in traces))})
    print(f"wrote {out}")


def add_train_parser(train) -> None:
    """`moetier train predictor`, in the `train` group."""
    from moetier.predictor_names import TRAINED

    tp = command(train, "predictor", "train a learned expert predictor on traces and save it with the model")
    tp.add_argument("--predictor", required=True, choices=TRAINED, help="the predictor to train")
    tp.add_argument("--trace", nargs="+", action="extend", required=True,
                    help="traces of the model recorded with --gate-inputs")
    tp.add_argument("--model", help="the model the traces are of, which it is saved with (its predictors/ folder; a "
                                    "built-in model's are not written: copy it first)")
    tp.add_argument("--epochs", type=count(), default=30, help="passes over the traces (LLaPor's paper: 30)")
    tp.add_argument("--out", help="write here instead")
    tp.add_argument("--cache-dir", help="where Hugging Face folders are converted")
    tp.set_defaults(func=_train_predictor)
