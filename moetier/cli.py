"""The `moetier` command."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from moetier.errors import MoetierError

DEFAULT_MODEL = "demo-fine"  # shipped in models/


def _generate(args: argparse.Namespace) -> None:
    from moetier.engine.engine import Engine
    from moetier.engine.stats import format_summary

    engine = Engine.from_pretrained(args.model, expert_memory=args.expert_memory, policy=args.policy,
                                    cache_dir=args.cache_dir, progress=not args.json,
                                    reader_threads=args.reader_threads)
    prompts = args.prompt
    stream = len(prompts) == 1 and not args.json

    def on_text(_: int, delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    with engine:
        if stream:
            sys.stdout.write(prompts[0])
        out = engine.generate(prompts, max_new_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed, on_text=on_text if stream else None)
    if args.json:
        print(json.dumps({"texts": out.texts, "token_ids": out.token_ids, "stats": out.stats}, indent=1))
        return
    if stream:
        print()
    else:
        for i, (prompt, text) in enumerate(zip(prompts, out.texts)):
            print(f"--- [{i}] {prompt}{text}")
    sys.stdout.flush()  # the text first, then the statistics line
    print(format_summary(out.stats), file=sys.stderr)


def _convert(args: argparse.Namespace) -> None:
    from moetier.store.convert import convert

    path = convert(args.hf_dir, args.store, overwrite=args.force)
    print(f"wrote {path}")


def _synth(args: argparse.Namespace) -> None:
    from moetier.store.synth import PRESETS, synthesize

    fields = {f.name for f in dataclasses.fields(PRESETS[args.preset])}
    overrides = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    spec = dataclasses.replace(PRESETS[args.preset], **overrides)
    path = synthesize(spec, args.out, overwrite=args.force)
    print(f"wrote {path}")


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
    fit = fit_locality(Trace.load(args.fit))
    trace = generate(fit, args.num_layers, args.num_experts, args.top_k, args.tokens, args.seed, args.name)
    trace.save(args.out)
    print(f"wrote {args.out}: {args.tokens} tokens, {args.num_layers} layers, top-{args.top_k} of "
          f"{args.num_experts}; zipf s={fit.zipf_s:.3f}, p_keep={fit.p_keep:.3f} (reuse t+1 {fit.reuse_next:.1%})")


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


def _calibrate(args: argparse.Namespace) -> None:
    from moetier.resolve import resolve_model
    from moetier.sim.calibrate import USER_PROFILES, calibrate
    from moetier.store.store import Store

    profile = calibrate(Store(resolve_model(args.model, args.cache_dir)), args.name, args.reader_threads)
    USER_PROFILES.mkdir(parents=True, exist_ok=True)
    path = Path(args.out) if args.out else USER_PROFILES / f"{args.name}.json"
    profile.save(path)
    print(f"wrote {path}: read {profile.link.bandwidth_bytes_per_s / 1e9:.2f} GB/s; expert "
          f"{profile.expert_compute(1) * 1e3:.3f} ms at 1 token (+{profile.expert_compute.per_token * 1e6:.1f} us "
          f"per token); dense {profile.dense_s_per_layer(1) * 1e3:.3f} ms per layer")


def _sim(args: argparse.Namespace) -> None:
    from moetier.cache.policies import make_policy
    from moetier.config import MemoryBudget
    from moetier.resolve import resolve_model
    from moetier.sim.profile import HardwareProfile
    from moetier.sim.replay import replay
    from moetier.sim.timing import simulate
    from moetier.store.store import Store
    from moetier.trace.format import Trace

    trace = Trace.load(args.trace)
    profile = HardwareProfile.load(args.profile)
    store = Store(resolve_model(args.model, args.cache_dir))
    if (store.spec.num_experts, store.spec.top_k) != (trace.num_experts, trace.top_k):
        raise MoetierError(f"the trace routes top-{trace.top_k} of {trace.num_experts} experts; {args.model} has "
                           f"top-{store.spec.top_k} of {store.spec.num_experts}")
    expert_bytes = store.native_layout.blob_bytes
    total = len(trace.layers) * trace.num_experts * expert_bytes  # a share is of the layers the trace covers
    slots = min(len(trace.layers) * trace.num_experts,
                MemoryBudget.parse(args.expert_memory).resolve(total, profile.fast_tier_bytes) // expert_bytes)
    if slots < trace.top_k:
        raise MoetierError(f"expert memory {args.expert_memory} holds {slots} experts; top-{trace.top_k} needs more")
    replayed = replay(trace, make_policy(args.policy), slots, preload=args.preload)
    result = simulate(trace, replayed, profile, expert_bytes, timeline_steps=(args.timeline_step,))
    summary = result.summary()
    summary.update(profile=profile.name, policy=args.policy, slots=slots)
    if args.timeline and result.timelines:
        from moetier.sim.timing import plot_timeline

        step, timeline = next(iter(result.timelines.items()))
        plot_timeline(timeline, args.timeline,
                      f"{trace.model} on {profile.name}, {args.policy}, {args.expert_memory}: step {step}")
        summary["timeline_plot"] = args.timeline
    print(json.dumps(summary, indent=1))


def build_parser() -> argparse.ArgumentParser:
    from moetier.cache.policies import POLICIES
    from moetier.store.synth import PRESETS

    parser = argparse.ArgumentParser(prog="moetier", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with experts offloaded to disk")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="Hugging Face folder, converted store, or built-in model name (default %(default)s)")
    g.add_argument("--prompt", action="append", required=True, help="repeat for a batch of prompts")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--expert-memory", default="30%", help="bytes (512MiB, 2GB), share of expert bytes (30%%), auto")
    g.add_argument("--policy", default="lru", choices=sorted(POLICIES))
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cache-dir", help="where Hugging Face folders are converted (default ~/.cache/moetier)")
    g.add_argument("--reader-threads", type=int, default=4)
    g.add_argument("--json", action="store_true", help="print texts and statistics as JSON")
    g.set_defaults(func=_generate)

    c = sub.add_parser("convert", help="convert a Hugging Face MoE checkpoint into a moetier store")
    c.add_argument("hf_dir")
    c.add_argument("store")
    c.add_argument("--force", action="store_true", help="replace an existing store")
    c.set_defaults(func=_convert)

    s = sub.add_parser("synth", help="write a synthetic store of real shape with random weights")
    s.add_argument("out")
    s.add_argument("--preset", default="olmoe-1b-7b", choices=sorted(PRESETS))
    for name in ("hidden_size", "num_layers", "num_experts", "intermediate_size", "top_k", "num_heads",
                 "num_kv_heads", "vocab_size", "seed"):
        s.add_argument("--" + name.replace("_", "-"), dest=name, type=int)
    s.add_argument("--precision", choices=["bf16", "fp16", "fp32"])
    s.add_argument("--embed-std", dest="embed_std", type=float)
    s.add_argument("--force", action="store_true")
    s.set_defaults(func=_synth)

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
    tsy.add_argument("--num-layers", type=int, required=True)
    tsy.add_argument("--num-experts", type=int, required=True)
    tsy.add_argument("--top-k", type=int, required=True)
    tsy.add_argument("--tokens", type=int, default=2000)
    tsy.add_argument("--seed", type=int, default=0)
    tsy.add_argument("--name", default="synthetic", help="model name recorded in the trace")
    tsy.add_argument("--out", required=True)
    tsy.add_argument("--force", action="store_true")
    tsy.set_defaults(func=_trace_synth)
    ts = t.add_parser("stats", help="locality statistics of a trace, with a plot")
    ts.add_argument("trace")
    ts.add_argument("--plot", help="PNG path (default TRACE/stats.png)")
    ts.add_argument("--json", action="store_true")
    ts.set_defaults(func=_trace_stats)

    cal = sub.add_parser("calibrate", help="measure this machine into the `this-machine` hardware profile")
    cal.add_argument("--model", default=DEFAULT_MODEL, help="the model whose expert shape to measure")
    cal.add_argument("--name", default="this-machine")
    cal.add_argument("--out", help="profile path (default ~/.cache/moetier/profiles/NAME.json)")
    cal.add_argument("--cache-dir")
    cal.add_argument("--reader-threads", type=int, default=4)
    cal.set_defaults(func=_calibrate)

    sm = sub.add_parser("sim", help="simulate a trace on a hardware profile with a policy and a budget")
    sm.add_argument("--trace", required=True)
    sm.add_argument("--profile", default="this-machine", help="a profile name or a JSON path")
    sm.add_argument("--model", default=DEFAULT_MODEL, help="the model whose shape the trace has")
    sm.add_argument("--policy", default="lru", choices=sorted(POLICIES))
    sm.add_argument("--expert-memory", default="30%")
    sm.add_argument("--preload", action="store_true", help="start with the cache filled, as Engine.preload")
    sm.add_argument("--cache-dir")
    sm.add_argument("--timeline", help="PNG path: per-layer reads and compute of one step")
    sm.add_argument("--timeline-step", type=int, default=-1, help="which step (default: the last)")
    sm.set_defaults(func=_sim)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except MoetierError as e:
        print(f"moetier: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
