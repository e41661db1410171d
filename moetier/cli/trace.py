"""`moetier trace record | import | synth | stats`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moetier.cli.defaults import SEED, command, count, finite, read_text_file, write_plot
from moetier.cli.generate import add_engine_options, check_engine_args, open_engine
from moetier.errors import MoetierError


def _check_out(args: argparse.Namespace, *sources) -> None:
    """The output trace folder, refused before any work: see `check_replaceable`."""
    from moetier.atomic import check_replaceable
    from moetier.trace.format import is_trace

    check_replaceable(args.out, "trace", is_trace, args.force, tuple(s for s in sources if s))


def _trace_import(args: argparse.Namespace) -> None:
    from moetier.trace.importers import import_trace

    _check_out(args, args.path)
    trace = import_trace(args.path, args.num_layers, args.num_experts, _warmup(args.warmup))
    trace.save(args.out, overwrite=args.force, sources=(args.path,))
    print(f"wrote {args.out}: {trace.num_tokens} tokens, layers {trace.layers}")
    for note in trace.notes:
        print(f"  note: {note}")


def _warmup(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise MoetierError(f"--warmup takes auto or a number of records, got {text!r}") from None


def _trace_record(args: argparse.Namespace) -> None:
    from moetier.engine.sampling import SamplingParams
    from moetier.progress import tqdm
    from moetier.resolve import builtin_names
    from moetier.trace.record import TraceRecorder

    params = SamplingParams(args.max_tokens, args.temperature, 1.0, args.seed)  # refuses bad values
    check_engine_args(args)
    prompts = [line for line in read_text_file(args.prompts, "prompts file").splitlines() if line.strip()]
    if not prompts:
        raise MoetierError(f"{args.prompts} holds no prompt", hint="write one prompt per line")
    _check_out(args, args.prompts)
    engine = open_engine(args, prompts=prompts)
    with engine, TraceRecorder(engine, gate_inputs=args.gate_inputs) as recorder:
        for prompt in tqdm(prompts, desc="record", unit="prompt"):
            engine.generate(prompt, max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                            seed=params.seed)
        trace = recorder.trace(prompts, model=args.model if args.model in builtin_names() else None)
    trace.save(args.out, overwrite=args.force)
    print(f"wrote {args.out}: {trace.num_tokens} token steps, {len(prompts)} sequences")


def _trace_synth(args: argparse.Namespace) -> None:
    from moetier.atomic import check_free_space
    from moetier.trace.format import Trace
    from moetier.trace.synthetic import fit_locality, generate, generate_seq2seq

    if args.tokens < 1:
        raise MoetierError(f"--tokens must be at least 1, got {args.tokens}")
    _check_out(args, args.fit)
    if args.model_shape:
        from moetier.cli.models import model_shape

        shape, _ = model_shape(args.model_shape)
        dims = dict(num_layers=shape.num_layers, num_experts=shape.num_experts, top_k=shape.top_k,
                    layers=list(shape.moe_layers), model=shape.name)
    elif None in (args.num_layers, args.num_experts, args.top_k):
        raise MoetierError("trace synth needs the model's shape", hint="pass --model-shape, or all of --num-layers, "
                                                                       "--num-experts and --top-k")
    else:
        dims = dict(num_layers=args.num_layers, num_experts=args.num_experts, top_k=args.top_k, model=args.name)
    encoder_layers = shape.encoder_layers if args.model_shape else 0
    tokens = args.tokens + (args.sequences * args.prompt_tokens if encoder_layers else 0)
    rows = tokens * len(dims.get("layers") or range(dims["num_layers"])) * dims["top_k"]
    check_free_space(args.out, rows * 4 + tokens * 9, f"the trace {Path(args.out).name}")  # before drawing it
    fit = fit_locality(Trace.load(args.fit))
    if encoder_layers:  # an encoder-decoder: prompts through the encoder, --tokens split among the generations
        trace = generate_seq2seq(fit, encoder_layers=encoder_layers, sequences=args.sequences,
                                 prompt_tokens=args.prompt_tokens, new_tokens=max(1, args.tokens // args.sequences),
                                 seed=args.seed, **dims)
    else:
        trace = generate(fit, tokens=args.tokens, seed=args.seed, **dims)
    trace.save(args.out, overwrite=args.force, sources=(args.fit,))
    prompts = f" (and {trace.encoder.num_tokens} prompt tokens through the encoder's {len(trace.encoder.layers)})" \
        if trace.encoder is not None else ""
    print(f"wrote {args.out}: {trace.num_tokens} tokens{prompts} of {trace.model}, {len(trace.layers)} MoE layers, top-"
          f"{trace.top_k} of {trace.num_experts}; zipf s={fit.zipf_s:.3f}, p_keep={fit.p_keep:.3f} "
          f"(reuse t+1 {fit.reuse_next:.1%})")


def _trace_stats(args: argparse.Namespace) -> None:
    from moetier.trace.format import Trace
    from moetier.trace.stats import format_table, plot, summarize

    trace = Trace.load(args.trace)
    summary = summarize(trace)
    png = Path(args.plot or Path(args.trace) / "stats.png")
    print(json.dumps(summary, indent=1) if args.json else format_table(summary), flush=True)  # before the plot
    if write_plot(lambda path: plot(trace, summary, path), png) and not args.json:
        print(f"plot: {png}")


def add_parser(sub) -> None:
    t = command(sub, "trace", "routing traces: record, import, synth, stats").add_subparsers(dest="trace_command",
                                                                                            required=True)
    force = "replace an existing trace (only a moetier trace; never the input)"
    ti = command(t, "import", "import a JSONL routing trace (a file, or a folder of them)")
    ti.add_argument("path", help="a JSON-lines trace file, or a folder of *.jsonl files")
    ti.add_argument("--out", required=True, help="the trace folder to write")
    ti.add_argument("--num-layers", type=count(1, 4096), help="the model's layers, if the trace cannot tell")
    ti.add_argument("--num-experts", type=count(1, 32768), help="experts per layer, if the trace cannot tell")
    ti.add_argument("--warmup", default="auto",
                    help="vLLM-MoE-Logger files: records to drop from the start of each layer (auto: a warm-up pass of "
                         "64 or more records routed alike, as the shared traces begin with; 0 keeps every record)")
    ti.add_argument("--force", action="store_true", help=force)
    ti.set_defaults(func=_trace_import)
    tr = command(t, "record", "record routing (full router scores) from moetier's engine")
    add_engine_options(tr, "100%")
    tr.add_argument("--prompts", required=True, help="a text file, one prompt per line")
    tr.add_argument("--out", required=True, help="the trace folder to write")
    tr.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt, at most")
    tr.add_argument("--temperature", type=finite(0, 100), default=0.0, help="0 is greedy")
    tr.add_argument("--seed", type=SEED, default=0, help="sampling seed")
    tr.add_argument("--gate-inputs", action="store_true", help="also record the router's inputs")
    tr.add_argument("--force", action="store_true", help=force)
    tr.set_defaults(func=_trace_record)
    tsy = command(t, "synth", "a synthetic trace of any shape, skew and locality fitted to a real one")
    tsy.add_argument("--fit", required=True, help="the trace to fit")
    tsy.add_argument("--model-shape", help="a model shape (`moetier list shapes`)")
    tsy.add_argument("--num-layers", type=count(1, 4096), help="without --model-shape: the model's layers")
    tsy.add_argument("--num-experts", type=count(1, 32768), help="without --model-shape: experts per layer")
    tsy.add_argument("--top-k", type=count(1, 32768), help="without --model-shape: experts per token")
    tsy.add_argument("--tokens", type=count(), default=2000, help="token steps to generate")
    tsy.add_argument("--seed", type=SEED, default=0, help="random seed")
    tsy.add_argument("--sequences", type=count(1, 100000), default=8,
                     help="an encoder-decoder shape's: sequences (--tokens are split among their generations)")
    tsy.add_argument("--prompt-tokens", type=count(1, 100000), default=128,
                     help="an encoder-decoder shape's: tokens of each prompt, through the encoder")
    tsy.add_argument("--name", default="synthetic", help="without --model-shape: the model name recorded")
    tsy.add_argument("--out", required=True, help="the trace folder to write")
    tsy.add_argument("--force", action="store_true", help=force)
    tsy.set_defaults(func=_trace_synth)
    ts = command(t, "stats", "locality statistics of a trace, with a plot")
    ts.add_argument("trace", help="a trace folder")
    ts.add_argument("--plot", help="PNG path (default TRACE/stats.png)")
    ts.add_argument("--json", action="store_true", help="print the statistics as JSON")
    ts.set_defaults(func=_trace_stats)
