"""`moetier trace record | import | synth | stats`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moetier.cli.defaults import DEFAULT_MODEL
from moetier.errors import MoetierError


def _trace_import(args: argparse.Namespace) -> None:
    from moetier.trace.importers import import_trace

    trace = import_trace(args.path, args.num_layers, args.num_experts)
    if Path(args.out).exists() and not args.force:
        raise MoetierError(f"{args.out} already exists", hint="choose another --out or pass --force")
    trace.save(args.out)
    print(f"wrote {args.out}: {trace.num_tokens} tokens, layers {trace.layers}")
    for note in trace.notes:
        print(f"  note: {note}")


def _trace_record(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from moetier.engine.engine import Engine
    from moetier.trace.record import TraceRecorder

    try:
        prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    except OSError as e:
        raise MoetierError(f"cannot read prompts from {args.prompts}: {e.strerror}") from None
    if not prompts:
        raise MoetierError(f"{args.prompts} holds no prompt", hint="write one prompt per line")
    if Path(args.out).exists() and not args.force:
        raise MoetierError(f"{args.out} already exists", hint="choose another --out or pass --force")
    engine = Engine.from_pretrained(args.model, expert_memory=args.expert_memory, cache_dir=args.cache_dir)
    with engine, TraceRecorder(engine, gate_inputs=args.gate_inputs) as recorder:
        for prompt in tqdm(prompts, desc="record", unit="prompt"):
            engine.generate(prompt, max_new_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        trace = recorder.trace(prompts)
    trace.save(args.out)
    print(f"wrote {args.out}: {trace.num_tokens} token steps, {len(prompts)} sequences")


def _trace_synth(args: argparse.Namespace) -> None:
    from moetier.trace.format import Trace
    from moetier.trace.synthetic import fit_locality, generate

    if Path(args.out).exists() and not args.force:
        raise MoetierError(f"{args.out} already exists", hint="choose another --out or pass --force")
    if args.model_shape:
        from moetier.sim.shapes import model_shape

        shape, _ = model_shape(args.model_shape)
        dims = dict(num_layers=shape.num_layers, num_experts=shape.num_experts, top_k=shape.top_k,
                    layers=list(shape.moe_layers), model=shape.name)
    elif None in (args.num_layers, args.num_experts, args.top_k):
        raise MoetierError("trace synth needs the model's shape", hint="pass --model-shape, or all of --num-layers, "
                                                                       "--num-experts and --top-k")
    else:
        dims = dict(num_layers=args.num_layers, num_experts=args.num_experts, top_k=args.top_k, model=args.name)
    fit = fit_locality(Trace.load(args.fit))
    trace = generate(fit, tokens=args.tokens, seed=args.seed, **dims)
    trace.save(args.out)
    print(f"wrote {args.out}: {args.tokens} tokens of {trace.model}, {len(trace.layers)} MoE layers, top-"
          f"{trace.top_k} of {trace.num_experts}; zipf s={fit.zipf_s:.3f}, p_keep={fit.p_keep:.3f} "
          f"(reuse t+1 {fit.reuse_next:.1%})")


def _trace_stats(args: argparse.Namespace) -> None:
    from moetier.trace.format import Trace
    from moetier.trace.stats import format_table, plot, summarize

    trace = Trace.load(args.trace)
    summary = summarize(trace)
    png = Path(args.plot or Path(args.trace) / "stats.png")
    plot(trace, summary, png)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(format_table(summary))
        print(f"plot: {png}")


def add_parser(sub) -> None:
    t = sub.add_parser("trace", help="routing traces: record, import, synth, stats").add_subparsers(dest="trace_command",
                                                                                    required=True)
    ti = t.add_parser("import", help="import a JSONL routing trace (a file, or a folder of them)")
    ti.add_argument("path")
    ti.add_argument("--out", required=True)
    ti.add_argument("--num-layers", type=int, help="the model's layers, if the trace cannot tell")
    ti.add_argument("--num-experts", type=int, help="experts per layer, if the trace cannot tell")
    ti.add_argument("--force", action="store_true")
    ti.set_defaults(func=_trace_import)
    tr = t.add_parser("record", help="record routing (full router scores) from moetier's engine")
    tr.add_argument("--model", default=DEFAULT_MODEL)
    tr.add_argument("--prompts", required=True, help="a text file, one prompt per line")
    tr.add_argument("--out", required=True)
    tr.add_argument("--max-tokens", type=int, default=64)
    tr.add_argument("--temperature", type=float, default=0.0)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--expert-memory", default="100%")
    tr.add_argument("--cache-dir")
    tr.add_argument("--gate-inputs", action="store_true", help="also record the router's inputs")
    tr.add_argument("--force", action="store_true")
    tr.set_defaults(func=_trace_record)
    tsy = t.add_parser("synth", help="a synthetic trace of any shape, skew and locality fitted to a real one")
    tsy.add_argument("--fit", required=True, help="the trace to fit")
    tsy.add_argument("--model-shape", help="a model shape (mixtral-8x7b, qwen3-30b-a3b, ...; see `moetier sim`)")
    tsy.add_argument("--num-layers", type=int, help="without --model-shape: the model's layers")
    tsy.add_argument("--num-experts", type=int, help="without --model-shape: experts per layer")
    tsy.add_argument("--top-k", type=int, help="without --model-shape: experts per token")
    tsy.add_argument("--tokens", type=int, default=2000)
    tsy.add_argument("--seed", type=int, default=0)
    tsy.add_argument("--name", default="synthetic", help="without --model-shape: the model name recorded")
    tsy.add_argument("--out", required=True)
    tsy.add_argument("--force", action="store_true")
    tsy.set_defaults(func=_trace_synth)
    ts = t.add_parser("stats", help="locality statistics of a trace, with a plot")
    ts.add_argument("trace")
    ts.add_argument("--plot", help="PNG path (default TRACE/stats.png)")
    ts.add_argument("--json", action="store_true")
    ts.set_defaults(func=_trace_stats)
