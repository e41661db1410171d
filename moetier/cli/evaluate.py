"""`moetier eval`: the quality cost of an approximating configuration against exact mode, in the engine."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from moetier.cache.policies import DEFAULT_POLICY
from moetier.cli.defaults import command, count, make_folder, out_folder, write_plot
from moetier.cli.generate import (
    add_engine_options,
    add_precision_options,
    add_prefetch_options,
    add_substitution_options,
    check_engine_args,
    precision_fields,
    substitution_config,
)
from moetier.errors import MoetierError

# sweepable parameter -> the MixedPrecision field it sets; SUBSTITUTION's set the Substitution, POLICY the policy
SWEEPABLE = {"precision": "precision", "t1": "t1", "t2": "t2", "low-precision": "low", "high-share": "high_share",
             "alpha": "alpha", "substitute-weight": "weight", "policy": "policy", "dense-precision": "dense_precision"}
SUBSTITUTION = ("alpha", "substitute-weight")
ENGINE = ("policy", "dense-precision")  # set an engine option, not a precision or substitution field


def parse_sweep(text: str | None) -> tuple[str | None, list[str]]:
    """`PARAM=V1,V2` -> (param, values); None -> no sweep."""
    if text is None:
        return None, []
    param, _, values = text.partition("=")
    if param not in SWEEPABLE or not values.strip(","):
        raise MoetierError(f"cannot sweep {text!r}", hint=f"PARAM=V1,V2,... with PARAM one of {', '.join(SWEEPABLE)}")
    return param, [v for v in values.split(",") if v]


def point(fields: dict, param: str | None, value: str):
    """The precision configuration of one sweep point (refused before any engine starts if it is invalid)."""
    from moetier.plan.precision import MixedPrecision

    if param is None or param in SUBSTITUTION or param in ENGINE:
        return MixedPrecision(**fields)
    field = {"precision": "mode"}.get(param, SWEEPABLE[param])
    try:
        v = value if field in ("mode", "low") else float(value)
    except ValueError:
        raise MoetierError(f"--sweep {param}: {value!r} is not a number") from None
    return MixedPrecision(**(fields | {field: v}))


def engine_config(args: argparse.Namespace, fields: dict, param: str | None, value: str) -> dict:
    """The engine options of one sweep point: precision, substitution and policy (checked before any engine runs)."""
    import dataclasses

    from moetier.cache.policies import check_policy
    from moetier.model.dense_quant import DENSE_PRECISIONS
    from moetier.plan.substitute import Substitution

    substitution = substitution_config(args)
    policy = value if param == "policy" else args.policy
    check_policy(policy, live=True)
    dense = value if param == "dense-precision" else args.dense_precision
    if dense not in DENSE_PRECISIONS:
        raise MoetierError(f"unknown dense precision {dense!r}", hint=f"one of {', '.join(DENSE_PRECISIONS)}")
    if param in SUBSTITUTION:
        if substitution is not None and not isinstance(substitution, Substitution):
            raise MoetierError(f"--sweep {param} sweeps SMoE's substitution; --substitute similar has no {param}",
                               hint="sweep with --substitute off, auto or an alpha")
        base = substitution or Substitution(None, args.substitute_weight, args.batch_aware)
        if param == "alpha":
            try:
                alpha = float(value)
            except ValueError:
                raise MoetierError(f"--sweep alpha: {value!r} is not a number") from None
            substitution = dataclasses.replace(base, alpha=alpha)
        else:
            substitution = dataclasses.replace(base, weight=value)
    return {"precision": point(fields, param, value), "substitution": substitution, "policy": policy,
            "prefetch": args.prefetch, "predictor": args.predictor, "predict_distance": args.predict_distance,
            "dense_precision": dense}


def texts(pairs: list[str] | None) -> dict[str, str]:
    """`NAME=FILE` pairs, or the demo models' held-out prose and code (train/corpus.py, in the repository)."""
    if pairs:
        out = {}
        for pair in pairs:
            name, _, path = pair.partition("=")
            if not name or not path:
                raise MoetierError(f"--text takes NAME=FILE, got {pair!r}")
            try:
                out[name] = Path(path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise MoetierError(f"cannot read {path}: {e}") from None
        return out
    corpus = demo_corpus("held-out", "--text prose=FILE --text code=FILE")
    return {"prose": corpus["prose_valid"], "code": corpus["code_valid"]}


def demo_corpus(which: str, hint: str) -> dict[str, str]:
    """The demo models' corpus ({'prose_train': text, 'prose_valid': ..., 'code_...'}), built by train/corpus.py
    beside the package in a checkout; refused with `hint` (what to give instead) elsewhere."""
    source = Path(__file__).resolve().parents[2] / "train" / "corpus.py"
    if not source.exists():
        raise MoetierError(f"the demo models' {which} texts are built by train/corpus.py in moetier's repository, "
                           "which this installation does not have", hint=f"give {hint}")
    spec = importlib.util.spec_from_file_location("moetier_demo_corpus", source)
    corpus_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus_module)
    return corpus_module.load()


def _eval(args: argparse.Namespace) -> None:
    from moetier.engine.engine import Engine
    from moetier.progress import tqdm
    from moetier.quality import Windows, sweep

    check_engine_args(args)
    if args.out:
        out_folder(args.out)
    fields = precision_fields(args)
    param, values = parse_sweep(args.sweep)
    own = args.precision if args.substitute == "off" else f"{args.precision}+substitute {args.substitute}"
    own += "" if args.dense_precision == "native" else f"+dense {args.dense_precision}"
    labels = ["exact"] + ([f"{param}={v}" for v in values] if param else [own])
    configs = {"exact": {"precision": point(fields | {"mode": "native"}, None, ""), "substitution": None,
                         "policy": args.policy}}  # exact plans, the same cache policy
    configs.update({f"{param}={v}": engine_config(args, fields, param, v) for v in values} if param else
                   {own: engine_config(args, fields, None, "")})
    if args.windows < 1 or args.prefix < 1 or args.window < args.prefix + 2 or args.batch < 1:
        raise MoetierError(f"--windows {args.windows}, --prefix {args.prefix}, --window {args.window}, --batch "
                           f"{args.batch}: need at least one window, a prefix of at least one token, two tokens to "
                           f"score after it, and a batch of at least one")
    sources = texts(args.text)

    def make_engine(label: str):
        return Engine.from_pretrained(args.model, expert_memory=args.expert_memory, cache_dir=args.cache_dir,
                                      progress=False, reader_threads=args.reader_threads, device=args.device,
                                      kernels=args.kernels, cuda_graphs=getattr(args, "cuda_graphs", False),
                                      **configs[label])

    with make_engine("exact") as engine:  # the tokenizer, and the model's first conversion with its progress
        if engine.tokenizer is None:
            raise MoetierError(f"{args.model} has no tokenizer to read the texts with")
        windows = [Windows.spread(name, engine.tokenizer.encode(text), args.window, args.windows)
                   for name, text in sources.items()]
    total = len(labels) * sum(len(w.rows) for w in windows)
    rows = []
    with tqdm(total=total, desc="eval", unit="window", disable=args.json) as bar:
        for row in sweep(make_engine, labels, windows, args.prefix, bar.update, args.batch):
            rows.append(row)
    report(rows, args)


def report(rows, args: argparse.Namespace) -> None:
    exact = rows[0]
    lines = [f"{'configuration':<24} " + " ".join(f"{'ppl ' + d['domain']:>11}" for d in exact.domains)
             + f" {'d ppl':>7} {'top-1':>6} {'KL':>7} {'tok/s':>7} {'speed':>6} {'MiB/tok':>8} {'hits':>5} {'low':>5} "
                f"{'skip':>5} {'subst':>5}"]
    records = []
    for row in rows:
        if row.note:
            records.append(row.to_json())
            lines.append(f"{row.label:<24} does not run: {row.note}")
            continue
        ppl = [d["perplexity"] for d in row.domains]
        change = float(sum(p / e["perplexity"] for p, e in zip(ppl, exact.domains)) / len(ppl) - 1)
        top1 = sum(d["top1_agreement"] * d["tokens"] for d in row.domains) / sum(d["tokens"] for d in row.domains)
        kl = sum(d["kl"] * d["tokens"] for d in row.domains) / sum(d["tokens"] for d in row.domains)
        speed = row.decode_tokens_per_s / exact.decode_tokens_per_s if exact.decode_tokens_per_s else float("nan")
        records.append(row.to_json() | {"perplexity_change": change, "top1_agreement": top1, "kl": kl,
                                        "speedup": speed})
        lines.append(f"{row.label:<24} " + " ".join(f"{p:11.2f}" for p in ppl)
                     + f" {change:+7.1%} {top1:6.1%} {kl:7.4f} {row.decode_tokens_per_s:7.1f} {speed:5.2f}x "
                     f"{row.expert_bytes_per_token / 2**20:8.2f} {row.hit_rate or 0:5.0%} {row.low_share:5.0%} "
                     f"{row.skipped:5d} {row.substituted:5d}")
    meta = {"model": args.model, "expert_memory": args.expert_memory, "window": args.window, "prefix": args.prefix,
            "windows": args.windows, "batch": args.batch, "policy": args.policy, "sweep": args.sweep,
            "rows": records}
    if args.json:
        print(json.dumps(meta, indent=1))
    else:
        print("\n".join(lines))
    if args.out:
        from moetier.atomic import atomic_write_json

        out = make_folder(Path(args.out))
        atomic_write_json(out / "eval.json", meta)
        drawn = write_plot(lambda path: plot(records, path, f"{args.model} at {args.expert_memory}, batch "
                                                         f"{args.batch}"), out / "eval.png")
        if not args.json:
            print(f"json: {out / 'eval.json'}" + (f"; plot: {out / 'eval.png'}" if drawn else ""))


def plot(records: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, name in ((axes[0], "perplexity_change", "perplexity change vs exact"),
                          (axes[1], "kl", "mean KL(exact || config), nats")):
        for r in (r for r in records if not r["note"]):
            ax.scatter(r["speedup"], r[key])
            ax.annotate(r["label"], (r["speedup"], r[key]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel="decode speed vs exact (x)", ylabel=name)
        ax.grid(alpha=0.3)
    axes[0].yaxis.set_major_formatter(PercentFormatter(1.0))
    fig.suptitle(f"speed against quality: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_parser(sub) -> None:
    e = command(sub, "eval", "measure what a configuration costs in quality against exact mode (perplexity, top-1 "
                             "agreement, KL) and what it gains in speed, in the engine on held-out text")
    add_engine_options(e, "25%")
    add_precision_options(e)
    add_substitution_options(e)
    add_prefetch_options(e)  # a prefetch changes what is cached, so what substitution finds at hand
    e.add_argument("--policy", default=DEFAULT_POLICY, help="eviction policy (`moetier list policies`)")
    e.add_argument("--sweep", metavar="PARAM=V1,V2",
                   help=f"one row per value of PARAM ({', '.join(SWEEPABLE)}), e.g. precision=int8,int4,hobbit")
    e.add_argument("--text", action="append", metavar="NAME=FILE",
                   help="a held-out text to score (repeatable; default: the demo models' held-out prose and code)")
    e.add_argument("--windows", type=count(), default=8, help="windows scored per text")
    e.add_argument("--window", type=count(), default=128, help="tokens per window")
    e.add_argument("--prefix", type=count(), default=16, help="tokens of each window fed as a prefill before scoring")
    e.add_argument("--batch", type=count(), default=1, help="windows of a text decoded together (a batch of sequences)")
    e.add_argument("--out", help="folder for eval.json and eval.png (speed against quality)")
    e.add_argument("--json", action="store_true", help="print the records as JSON")
    e.set_defaults(func=_eval)
