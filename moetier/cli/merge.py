"""`moetier merge`: CoMoE's merged variants of a model (moetier/merge, docs/merging.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moetier.cli.defaults import command, count, read_text_file
from moetier.cli.generate import add_engine_options, check_engine_args, open_engine
from moetier.errors import MoetierError

WINDOW = 256  # calibration tokens per prefill


def retention(args: argparse.Namespace):
    """How many experts a layer keeps: exactly one of --ratio, --adaptive, --threshold (θ_act alone)."""
    from moetier.merge.plan import ADAPTIVE, ActivationThreshold, AdaptiveRatio, FixedRatio

    given = [f"--{name}" for name in ("ratio", "adaptive", "threshold") if getattr(args, name) is not None]
    if len(given) != 1:
        raise MoetierError(f"give one way to choose the experts kept, not {' and '.join(given)}" if given else
                           "give one way to choose the experts kept",
                           hint="--ratio R, --adaptive {light,medium,heavy}, --threshold θ_act, or --library")
    if args.ratio is not None:
        return FixedRatio(args.ratio)
    if args.threshold is not None:
        return ActivationThreshold(args.threshold)
    r_base, delta_r = ADAPTIVE[args.adaptive]
    return AdaptiveRatio(r_base, delta_r, args.min_experts, args.adaptive)


def calibration_text(args: argparse.Namespace) -> tuple[str, str]:
    """(text, what it is): --calibration's file, or the demo models' training prose and code."""
    if args.calibration:
        return read_text_file(args.calibration, "calibration file"), args.calibration
    from moetier.cli.evaluate import demo_corpus

    corpus = demo_corpus("training", "--calibration FILE (text like what the model will see)")
    return corpus["prose_train"] + "\n" + corpus["code_train"], "the demo corpus's training prose and code"


def spread(ids: list[int], tokens: int, window: int = WINDOW) -> list[list[int]]:
    """Windows of `window` tokens, `tokens` in all, spread evenly over the text (so a text of several kinds — prose,
    then code — is sampled from each, not only from its start); the whole text if it is shorter."""
    if len(ids) <= tokens:
        return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids) - i >= 2]
    n = max(1, tokens // window)
    starts = [round(i * (len(ids) - window) / max(1, n - 1)) for i in range(n)]
    return [ids[s:s + window] for s in starts]


def calibrate(args: argparse.Namespace, text: str, what: str):
    """The trace of the model's routing and router inputs on the calibration `text`."""
    from moetier.progress import tqdm
    from moetier.trace.record import TraceRecorder

    engine = open_engine(args)
    with engine, TraceRecorder(engine, gate_inputs=True) as recorder:
        if engine.tokenizer is None:
            raise MoetierError(f"{args.model} has no tokenizer to read the calibration text with")
        window = min(WINDOW, engine.spec.max_position_embeddings - 1)  # (a prefill and the one token after it)
        windows = spread(engine.tokenizer.encode(text), args.calibration_tokens, window)
        if not windows:
            raise MoetierError(f"{what} holds no tokens to calibrate on", hint="give a longer --calibration text")
        for ids in tqdm(windows, desc="calibrate", unit="window"):
            engine.generate([ids], max_new_tokens=1)  # (the prefill routes and records the window's tokens)
        return recorder.trace([f"window {i}" for i in range(len(windows))])


def source_model(args: argparse.Namespace, outs: list[Path], settings) -> Path:
    """The model to merge, resolved (a Hugging Face folder converted), once `outs` — the stores to write — are known
    writable; refused if it cannot be merged, if it is one of them, or if `settings` do not apply to it."""
    from moetier.atomic import check_replaceable
    from moetier.merge.merge import check_mergeable
    from moetier.resolve import resolve_model
    from moetier.store.format import is_store
    from moetier.store.store import Store

    for out in outs:  # before anything is converted or loaded
        check_replaceable(out, "store", is_store, args.force)
    source = resolve_model(args.model, args.cache_dir)
    for out in outs:
        check_replaceable(out, "store", is_store, args.force, (source,))
    check_mergeable(Store(source))
    settings.scope_for(Store(source).spec)
    return source


def _merge(args: argparse.Namespace) -> None:
    from moetier.merge.merge import MergeSettings

    check_engine_args(args)
    if args.library:
        return _library(args)
    settings = MergeSettings(retention(args), args.alpha, args.align, args.members, args.refit, args.scope)  # refused first
    text, what = calibration_text(args)
    source = source_model(args, [Path(args.out)], settings)
    report = _write(source, Path(args.out), calibrate(args, text, what), settings, what, args.force)
    print(f"  its perplexity beside the original's: moetier eval --model {report.path} (and --model {args.model}); "
          f"the paper's six with their quality: moetier merge --library", file=sys.stderr)


def _write(source: Path, out: Path, trace, settings, what: str, force: bool):
    from moetier.config import format_bytes
    from moetier.merge.merge import merge_store

    report = merge_store(source, out, trace, settings, overwrite=force, calibration=what)
    kept = report.kept
    layers = ", ".join(map(str, kept)) if len(set(kept)) > 1 else f"{kept[0]} in each of {len(kept)} layers"
    print(f"wrote {report.path}: {settings.retention.name}, experts kept of {report.num_experts} a layer: {layers}; "
          f"expert bytes {format_bytes(report.bytes_before)} -> {format_bytes(report.bytes_after)} "
          f"({report.bytes_after / report.bytes_before:.0%}); calibrated on {trace.num_tokens} tokens of {what}",
          flush=True)
    return report


def _library(args: argparse.Namespace) -> None:
    """The paper's six variants into --out/<name>, each scored against the original on held-out text, listed in
    --out/library.json with a plot of quality against bytes."""
    from moetier.cli.evaluate import texts
    from moetier.merge.library import FILE, Library, paper_variants
    from moetier.merge.merge import MergeSettings

    if args.ratio is not None or args.adaptive is not None or args.threshold is not None:
        raise MoetierError("--library builds the paper's six variants", hint="drop --ratio, --adaptive, --threshold")
    folder = Path(args.out)
    variants = paper_variants(args.min_experts)
    first = MergeSettings(variants["fixed-light"], args.alpha, args.align, args.members, args.refit, args.scope)
    # (refuses bad values before any work)
    if (folder / FILE).exists():
        Library.load(folder)  # a library.json that is not one (someone else's file) is refused, not replaced
    sources = texts(args.text)  # the held-out texts to score on
    text, what = calibration_text(args)
    source = source_model(args, [folder / name for name in variants], first)
    trace = calibrate(args, text, what)
    for name, retention in variants.items():
        settings = MergeSettings(retention, args.alpha, args.align, args.members, args.refit, args.scope)
        _write(source, folder / name, trace, settings, what, args.force)
    library = score_library(args, source, folder, list(variants), sources)
    print(library_table(library))
    print(f"wrote {library.save(folder)}")
    from moetier.cli.defaults import write_plot

    if write_plot(lambda path: plot_library(library, path, args.model), folder / "library.png"):
        print(f"plot: {folder / 'library.png'}")


def score_library(args: argparse.Namespace, source: Path, folder: Path, names: list[str], sources: dict):
    """Every variant scored with `moetier eval`'s measures against the original's own log-probabilities."""
    from moetier.engine.engine import Engine
    from moetier.merge.library import Library, Variant
    from moetier.progress import tqdm
    from moetier.quality import Windows, sweep
    from moetier.store.store import Store

    paths = {"original": source, **{n: folder / n for n in names}}

    def make_engine(label: str):
        return Engine.from_pretrained(paths[label], expert_memory="100%", progress=False, kernels=args.kernels)

    with make_engine("original") as engine:
        windows = [Windows.spread(name, engine.tokenizer.encode(text), args.window, args.windows)
                   for name, text in sources.items()]
    variants = []
    with tqdm(total=len(paths) * sum(len(w.rows) for w in windows), desc="score", unit="window") as bar:
        for row in sweep(make_engine, list(paths), windows, args.prefix, bar.update):
            store = Store(paths[row.label])
            spec = store.spec
            ppl = {d["domain"]: d["perplexity"] for d in row.domains}
            base = variants[0].quality["perplexity"] if variants else ppl
            tokens = sum(d["tokens"] for d in row.domains)
            quality = {"perplexity": ppl,
                       "perplexity_change": sum(ppl[k] / base[k] for k in ppl) / len(ppl) - 1,
                       "top1_agreement": sum(d["top1_agreement"] * d["tokens"] for d in row.domains) / tokens,
                       "kl": sum(d["kl"] * d["tokens"] for d in row.domains) / tokens}
            variants.append(Variant(row.label, str(paths[row.label]), store.total_expert_bytes(),
                                    tuple(len(spec.experts_of(layer)) for layer in spec.moe_layers), quality))
    return Library(str(source), tuple(variants))


def library_table(library) -> str:
    original = library.variants[0].expert_bytes
    domains = list(library.variants[0].quality["perplexity"])
    lines = [f"{'variant':<18} {'experts/layer':>13} {'bytes':>6} " + " ".join(f"{'ppl ' + d:>11}" for d in domains)
             + f" {'d ppl':>7} {'top-1':>6} {'KL':>7}"]
    for v in library.variants:
        q = v.quality
        kept = f"{min(v.kept)}-{max(v.kept)}" if min(v.kept) != max(v.kept) else str(v.kept[0])
        lines.append(f"{v.name:<18} {kept:>13} {v.expert_bytes / original:6.0%} "
                     + " ".join(f"{q['perplexity'][d]:11.2f}" for d in domains)
                     + f" {q['perplexity_change']:+7.1%} {q['top1_agreement']:6.1%} {q['kl']:7.4f}")
    return "\n".join(lines)


def plot_library(library, path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    original = library.variants[0].expert_bytes
    fig, ax = plt.subplots(figsize=(6, 4))
    for v in library.variants:
        x, y = v.expert_bytes / original, 100 * v.quality["perplexity_change"]
        ax.scatter([x], [y], color="black" if v.name == "original" else "tab:blue")
        ax.annotate(v.name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("expert bytes (share of the original's)")
    ax.set_ylabel("perplexity change (%)")
    ax.set_title(f"{model}: merged variants (CoMoE)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_parser(sub) -> None:
    from moetier.merge.plan import ADAPTIVE

    m = command(sub, "merge", "merge similar experts into fewer (CoMoE): a new, smaller store that runs like any "
                              "other model (docs/merging.md)")
    add_engine_options(m, "100%")
    m.add_argument("--out", required=True, help="the store folder to write (with --library: the folder of variants)")
    how = m.add_mutually_exclusive_group()  # (--threshold too: retention() refuses none or two)
    how.add_argument("--library", action="store_true",
                     help="build the paper's six variants (fixed and adaptive, light/medium/heavy) into --out, score "
                          "each against the original on held-out text, list them in --out/library.json")
    how.add_argument("--ratio", type=float, help="keep ⌊ratio·E⌋ experts in every layer (the paper's light, medium, "
                                                 "heavy: 0.75, 0.5, 0.25)")
    how.add_argument("--adaptive", choices=sorted(ADAPTIVE), help="keep more experts where a layer's routing is "
                                                                  "spread (Eq. 33 with the paper's r_base, Δr)")
    m.add_argument("--min-experts", type=count(), default=1, help="with --adaptive: E_min (never below top-k)")
    m.add_argument("--alpha", type=float, default=0.5, help="weight of parameter similarity against functional "
                                                            "(Eq. 27)")
    m.add_argument("--threshold", type=float, help="θ_act: keep the experts above this share of a layer's "
                                                   "activations (instead of --ratio or --adaptive)")
    m.add_argument("--no-align", dest="align", action="store_false",
                   help="average members unit by unit as Eq. 30 is written, without matching their hidden units to "
                        "the principal's first")
    m.add_argument("--members", choices=["average", "principal"], default="average",
                   help="a merged expert's weights: its group averaged by frequency (Eq. 30), or the principal's own "
                        "(a baseline: the others pruned, their tokens sent to it)")
    m.add_argument("--refit", choices=["none", "down", "all"], default=None,
                   help="then fit each merged expert to its group's outputs on the calibration tokens: all (the "
                        "default for experts of at most 2^20 parameters, as the demo models': minutes) every weight by "
                        "gradient steps; down (the default for larger ones, where tuning takes hours on a CPU) its "
                        "down projection by least squares; none: Eq. 30's average alone (and --members principal's "
                        "own weights, its only choice)")
    m.add_argument("--scope", choices=["all", "encoder"], default=None,
                   help="which MoE layers merge: all (the default for a decoder alone), or an encoder-decoder's "
                        "encoder alone, its decoder's experts kept whole (CoMoE's encoder-focused aggregation, §III-B "
                        "3: the default for Switch)")
    m.add_argument("--calibration", help="a text file to calibrate on (default: the demo models' training text)")
    m.add_argument("--calibration-tokens", type=count(WINDOW), default=8192,
                   help="tokens of it to route (the refit gains from more: docs/merging.md)")
    m.add_argument("--text", action="append", metavar="NAME=FILE",
                   help="with --library: held-out text to score on (default: the demo models' prose and code)")
    m.add_argument("--windows", type=count(), default=8, help="with --library: windows scored per text")
    m.add_argument("--window", type=count(3), default=128, help="with --library: tokens per window")
    m.add_argument("--prefix", type=count(), default=16, help="with --library: tokens of each window before scoring")
    m.add_argument("--force", action="store_true", help="replace an existing store at --out (only a moetier store)")
    m.set_defaults(func=_merge)


def add_train_parser(train) -> None:
    """`moetier train similarity`: the expert similarities CoMoE's similar-expert substitution reads."""
    sp = command(train, "similarity", "compute each MoE layer's expert similarity (CoMoE Eq. 25-27, as merging "
                                      "measures it) from a calibration trace and save it with the model, for "
                                      "--substitute similar")
    sp.add_argument("--trace", required=True, help="a trace of the model recorded with --gate-inputs")
    sp.add_argument("--model", required=True, help="the model the trace is of (its experts are read)")
    sp.add_argument("--out", help="write here instead of the model's policies/ folder (a built-in model's are not "
                                  "written: copy it first)")
    sp.add_argument("--alpha", type=float, default=0.5, help="Eq. 27's weight of parameter against functional "
                                                             "similarity, in [0, 1]")
    sp.add_argument("--cache-dir", help="where Hugging Face folders are converted")
    sp.set_defaults(func=_train_similarity)


def _train_similarity(args: argparse.Namespace) -> None:
    from moetier.cli.cache import trained_destination
    from moetier.merge.merge import check_trace, layer_similarity, layer_tables
    from moetier.policy_files import SIMILARITY, policy_file, save_similarity
    from moetier.progress import tqdm
    from moetier.resolve import resolve_model
    from moetier.store.store import Store
    from moetier.trace.format import Trace

    if not 0 <= args.alpha <= 1:
        raise MoetierError(f"--alpha must be in [0, 1], got {args.alpha}")
    trace = Trace.load(args.trace)
    out = trained_destination(args, trace, lambda folder: policy_file(folder, SIMILARITY))
    store = Store(resolve_model(args.model, args.cache_dir, progress=False))
    check_trace(store, trace)
    layers = {layer: layer_similarity(store, layer, column, table, args.alpha)
              for layer, (table, column) in zip(tqdm(store.spec.moe_layers, desc="similarity", unit="layer"),
                                                layer_tables(trace))}
    save_similarity(out, layers, args.alpha, trace.model, tokens=int(trace.num_tokens))
    print(f"wrote {out} ({len(layers)} layers of {store.spec.num_experts} experts)")
