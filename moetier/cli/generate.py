"""`moetier generate`."""

from __future__ import annotations

import argparse
import json
import sys
import time

from moetier.cache.policies import DEFAULT_POLICY, LIVE_POLICIES
from moetier.cli.defaults import (
    DEFAULT_MODEL,
    add_sampling_options,
    checked,
    command,
    count,
    finite,
    read_prompts,
    sampling_args,
)
from moetier.config import KERNELS, HostMemory, MemoryBudget
from moetier.errors import MoetierError
from moetier.resolve import check_model


def check_engine_args(args: argparse.Namespace) -> None:
    """What a run's engine options say, refused before any model is resolved, converted or loaded."""
    from moetier.config import MemoryBudget
    from moetier.engine.engine import check_device
    from moetier.store.reader import check_reader_threads

    MemoryBudget.parse(args.expert_memory)
    device = check_device(args.device)
    if getattr(args, "placement", "none") != "none" and device.type == "cpu":
        raise MoetierError(f"--placement {args.placement} chooses between reading an expert into the GPU and "
                           f"computing it on the CPU beside it: it needs --device cuda",
                           hint=f"on a CPU-only machine the simulator runs it: moetier sim --placement "
                                f"{args.placement} --profile rtx4090 ...")
    check_reader_threads(args.reader_threads)
    if getattr(args, "variants", None) is not None:
        from moetier.merge.library import Library

        if not getattr(args, "adapt", False):
            raise MoetierError("--variants switches between a model's merged variants as the memory changes: it "
                               "needs --adapt", hint="add --adapt")
        Library.load(args.variants)  # a folder without a readable library.json: refused before anything loads


def check_prompt_lengths(model: str, prompts: list[str]) -> None:
    """Each prompt tokenised with the model's own tokenizer and checked against its context window before anything
    is converted or loaded (config.json and the tokenizer files alone), so a refused prompt costs nothing and
    prints nothing of itself."""
    from moetier.engine.generate import check_prompts
    from moetier.model_info import inspect_model

    info = inspect_model(model)
    tokenizer = info.tokenizer()
    if tokenizer is not None:
        check_prompts([tokenizer.encode(p) for p in prompts], info.spec.max_position_embeddings, info.spec.vocab_size)


def open_engine(args: argparse.Namespace, progress: bool = True, prompts: list[str] | None = None, **config):
    """The engine for `args`, with the one stderr line saying what expert cache it reserved and why. Its options,
    then `prompts` against the model's context window, are checked before anything is converted or loaded."""
    from moetier.config import HostMemory, MemoryBudget
    from moetier.engine.engine import Engine, EngineConfig

    if getattr(args, "host_memory", None) is not None:
        config.setdefault("host_memory", HostMemory.parse(args.host_memory))
    config.setdefault("adapt", getattr(args, "adapt", False))
    config.setdefault("offload", getattr(args, "offload", "all"))
    config.setdefault("variants", getattr(args, "variants", None))
    config.setdefault("cuda_graphs", getattr(args, "cuda_graphs", False))
    EngineConfig(expert_memory=MemoryBudget.parse(args.expert_memory), reader_threads=args.reader_threads,
                 device=args.device, kernels=args.kernels, **config)  # refuses what the options say, first
    if prompts:
        check_prompt_lengths(args.model, prompts)
    engine = Engine.from_pretrained(args.model, expert_memory=args.expert_memory, cache_dir=args.cache_dir,
                                    progress=progress, reader_threads=args.reader_threads, device=args.device,
                                    kernels=args.kernels, reconvert=getattr(args, "reconvert", False), **config)
    print(f"moetier: {engine.budget.note}", file=sys.stderr)
    split = engine.executor.residency.layers
    if engine.config.cache_partition == "auto" and split:
        print(f"moetier: the expert cache is split among the {len(split)} MoE layers, as --speculate under a budget "
              f"needs (--cache-partition global shares it: docs/serving.md)", file=sys.stderr)
    if engine.host_note:
        print(f"moetier: {engine.host_note}", file=sys.stderr)
    if getattr(args, "preload", False):
        start = time.perf_counter()
        loaded = engine.preload()
        print(f"moetier: preloaded {loaded} experts in {time.perf_counter() - start:.2f} s", file=sys.stderr)
    return engine


def _generate(args: argparse.Namespace) -> None:
    from moetier.engine.engine import sampling_params
    from moetier.engine.stats import format_summary

    sampling = sampling_args(args)
    sampling_params(args.max_tokens, **sampling)  # refuses bad values, before anything loads
    check_engine_args(args)
    speculation_config(args)
    prompts = read_prompts(args.prompt, args.prompt_file)
    engine = open_engine(args, progress=not args.json, prompts=prompts, policy=args.policy,
                         cache_partition=args.cache_partition, prefetch=args.prefetch, predictor=args.predictor,
                         predict_distance=args.predict_distance, precision=precision_config(args),
                         substitution=substitution_config(args), placement=args.placement,
                         speculation=speculation_config(args),
                         dense_precision=args.dense_precision)
    stream = len(prompts) == 1 and not args.json

    def on_text(_: int, delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    with engine:
        if args.tpot_budget is not None:
            choice = engine.tune_substitution(parse_seconds(args.tpot_budget), prompts, progress=not args.json)
            print(f"moetier: {choice.describe()}", file=sys.stderr)
        text_to_text = engine.spec.encoder_decoder is not None  # its output is a new text, not a continuation
        if stream and not text_to_text:
            sys.stdout.write(prompts[0])
        out = engine.generate(prompts, max_new_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                              on_text=on_text if stream else None, **sampling)
    if args.json:
        print(json.dumps({"texts": out.texts, "token_ids": out.token_ids, "stats": out.stats}, indent=1))
        return
    if stream:
        print()
    else:
        for i, (prompt, text) in enumerate(zip(prompts, out.texts)):
            print(f"--- [{i}] {prompt} → {text}" if text_to_text else f"--- [{i}] {prompt}{text}")
    sys.stdout.flush()  # the text first, then the notes and the statistics line
    context = engine.spec.max_position_embeddings
    for b in out.stats["stopped_at_context"]:
        print(f"note: generation of prompt {b} stopped at the model's context window ({context} tokens) after "
              f"{len(out.token_ids[b])} new tokens", file=sys.stderr)
    print(format_summary(out.stats), file=sys.stderr)
    graphs = getattr(engine.model, "graphs", None)
    if graphs is not None:
        print(f"moetier: {graphs.note}", file=sys.stderr)


def add_engine_options(p: argparse.ArgumentParser, expert_memory: str) -> None:
    """Options of every command that runs the engine."""
    p.add_argument("--model", default=DEFAULT_MODEL, type=checked(check_model),
                   help="Hugging Face folder, GGUF file, converted store, or built-in model name (`moetier list "
                        "models`)")
    p.add_argument("--expert-memory", default=expert_memory, type=checked(MemoryBudget.parse),
                   help="expert cache: bytes (512MiB, 2GB), a share of all expert bytes at the run's precision "
                        "(30%%), or auto (what the host and the container allow, less the dense weights, the "
                        "runtime and a 1,024-token prompt)")
    p.add_argument("--cache-dir", help="where Hugging Face folders are converted (default: $MOETIER_CACHE or "
                                       "~/.cache/moetier)")
    p.add_argument("--reader-threads", type=int, default=4, help="threads reading experts from disk")
    p.add_argument("--device", default="cpu", help="where the dense weights, the expert cache and the kernels live: "
                                                   "cpu, or cuda[:N] on a machine with a GPU")
    p.add_argument("--host-memory", type=checked(HostMemory.parse),
                   help="with --device cuda: host memory for the experts behind the GPU's cache, page-locked, the "
                        "disk behind it: bytes (8GiB), a share of the experts (50%%), auto (the default: every expert "
                        "where the host has room, read at start-up), or 0 (none: every miss is read from disk)")
    p.add_argument("--preload", action="store_true",
                   help="fill the expert cache before the first token, layer by layer (with --expert-memory 100%%: "
                        "the whole model resident from the start, as a benchmark's harness runs it; without it the "
                        "cache fills as tokens need experts)")
    p.add_argument("--adapt", action="store_true",
                   help="resize the expert cache while running to the memory free beside it (CoMoE Eq. 17): it "
                        "shrinks when other processes take memory and grows back when they give it up; each change "
                        "is one line on stderr")
    p.add_argument("--variants", metavar="FOLDER",
                   help="with --adapt: a merge library (moetier merge --library) holding this model; between requests "
                        "run the best-quality variant of at most the experts the memory free holds (CoMoE Eq. 17, "
                        "34-35)")
    p.add_argument("--offload", default="all", choices=["all", "encoder"],
                   help="whose experts the cache offloads: every MoE layer's (default), or an encoder-decoder's "
                        "(Switch) encoder's alone, the decoder's kept resident (CoMoE's encoder-focused offloading)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="with --device cuda: a decode step of up to 8 sequences replayed as a CUDA graph where "
                        "every expert is resident (--expert-memory 100%%), one launch instead of ~300; below that, "
                        "each layer's attention and router one graph, the experts between (docs/gpu.md)")
    p.add_argument("--kernels", default="auto", choices=KERNELS,
                   help="auto (default): moetier's native kernels for bf16 decoding on the CPU, built on first use with "
                        "the C compiler (the best instruction set this CPU runs; a prefill's products in torch's GEMM "
                        "where the CPU has bf16 dot products), else torch's; torch; native (refuse if they cannot be "
                        "built); or one path by name, refused where this CPU lacks it: avx2, avx2-vnni (AVX2 with "
                        "AVX-VNNI's integer dot products), avx512 (that library for every product), amx (the AVX-512 library for decode, torch's GEMM on AMX for prefills)")


def add_precision_options(p: argparse.ArgumentParser) -> None:
    """Options of every command that runs the engine at chosen precisions (docs/mixed-precision.md)."""
    from moetier.plan.precision import CACHED, MODES, UNIFORM

    p.add_argument("--precision", default="native", choices=MODES,
                   help="native (exact); int8/int4/int2, or q8_0/q6_k/q5_k/q4_k/q4_k_m/mxfp4 (GGML's formats, "
                        "fitted as llama-quantize fits them): every expert at that copy; hobbit (a missing expert loaded "
                        "at high or low precision by its gate, or skipped); low-tier (every expert resident at low "
                        "precision, the important ones cached at high)")
    p.add_argument("--low-precision", default="", choices=["", *UNIFORM], metavar="{" + ",".join(UNIFORM) + "}",
                   help="hobbit/low-tier: the low copy (default int4 for hobbit; q4_k for llama.cpp's Q4_K; for "
                        "low-tier the most precise that fits in 75%% of the budget)")
    p.add_argument("--high-precision", default="", choices=["", "int8", "q8_0"], metavar="{int8,q8_0}",
                   help="hobbit/low-tier: the high copy (default the model's own; int8 pairs with int2 as in HOBBIT, "
                        "q8_0 with q4_k as llama.cpp's formats)")
    p.add_argument("--thresholds", default=None, metavar="T1,T2",
                   help="HOBBIT's importance thresholds (default: the model's fitted ones if it has them, else the "
                        "paper's 0.6,0.9; low-tier T2 1.0: no skipping)")
    p.add_argument("--high-share", type=finite(0, 1), default=0.75,
                   help="hobbit: the high-precision sub-cache's share of the expert budget")
    p.add_argument("--hobbit-cached", default="by-gate", choices=CACHED,
                   help="hobbit: by-gate (the paper, default): a cached low copy of an important expert is a miss "
                        "at high precision; as-held: any cached copy runs at the precision it is held at (fewer "
                        "reads, important experts at low precision)")
    p.add_argument("--dense-precision", default="native", choices=["native", "int8", "int4", "q8_0", "q4_k_m"],
                   help="the attention projections and the head: native (exact; a GGUF's: its own blocks), or "
                        "quantized at load to our int8/int4 or to GGML's q8_0/q4_k_m as llama.cpp's Q8_0 and Q4_K_M "
                        "files hold them (fitted as ggml fits them: slow to load for a big model); the embedding "
                        "and norms stay")


def precision_fields(args: argparse.Namespace) -> dict:
    """MixedPrecision's fields from the precision options (T2 None when not given: the mode's own default)."""
    t1 = t2 = None  # the model's defaults
    if args.thresholds is not None:
        try:
            t1, t2 = (float(v) for v in args.thresholds.split(","))
        except ValueError:
            raise MoetierError(f"--thresholds takes T1,T2 (e.g. 0.6,0.9), got {args.thresholds!r}") from None
    return {"mode": args.precision, "high": args.high_precision, "low": args.low_precision, "t1": t1, "t2": t2,
            "high_share": args.high_share, "cached": args.hobbit_cached}


def precision_config(args: argparse.Namespace):
    from moetier.plan.precision import MixedPrecision

    return MixedPrecision(**precision_fields(args))


def add_partition_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-partition", default="auto", choices=["auto", "global", "per-layer"],
                   help="one expert cache for all layers, or the slots split evenly among them; auto: per-layer "
                        "where --speculate verifies drafts under a budget (a global LRU cache thrashes on verify "
                        "steps: docs/serving.md), else global")


def add_speculation_options(p: argparse.ArgumentParser) -> None:
    """Options of every command that decodes: speculative decoding by prompt lookup (docs/serving.md)."""
    p.add_argument("--speculate", type=int, default=0, metavar="K",
                   help="draft up to K tokens a step by prompt lookup (the context's own n-grams) and verify them in "
                        "one step, which reads the union of their experts once; gated off where it does not pay (0: off, "
                        "the default)")


def speculation_config(args: argparse.Namespace):
    from moetier.engine.speculative import Speculation

    if args.speculate < 0:
        raise MoetierError(f"--speculate takes a number of draft tokens >= 0, got {args.speculate}",
                           hint="e.g. --speculate 4 (0: off)")
    return Speculation(tokens=args.speculate) if args.speculate else None


def add_substitution_options(p: argparse.ArgumentParser) -> None:
    """Options of every command that runs the engine with SMoE's substitution (docs/substitution.md)."""
    from moetier.plan.substitute import WEIGHTS

    p.add_argument("--substitute", default="off", metavar="ALPHA",
                   help="replace a missing low-score expert by a cached one of similar score (SMoE): off (default, "
                        "exact), auto (the paper's alpha for the model's size: 0.35 up to 20B expert parameters), or "
                        "alpha in [0, 1); or `similar`: a mispredicted low-priority expert by the most similar cached "
                        "one (CoMoE §III-D; needs `moetier train similarity`)")
    p.add_argument("--substitute-weight", default="scaled", choices=WEIGHTS,
                   help="a substitute's weight: scaled (its own gate under the routing's normalisation) or inherit "
                        "(the replaced expert's)")
    p.add_argument("--no-batch-aware", dest="batch_aware", action="store_false",
                   help="substitute only cached experts, not other tokens' top-score experts of the step")


def add_budget_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tpot-budget", metavar="TIME",
                   help="decode-time budget per token (80ms): a short calibration run on the prompt measures TPOT at "
                        "alpha 0-0.6 and substitutes with the smallest alpha whose fitted TPOT meets it (SMoE §V-C)")


def parse_seconds(text: str) -> float:
    """A duration: `80ms`, `0.08s`, or `80` (milliseconds)."""
    t = text.strip().lower()
    scale = 1e-3
    if t.endswith("ms"):
        t = t[:-2]
    elif t.endswith("s"):
        t, scale = t[:-1], 1.0
    try:
        value = float(t) * scale
    except ValueError:
        raise MoetierError(f"{text!r} is not a duration", hint="e.g. 80ms, 0.08s") from None
    if not value > 0:
        raise MoetierError(f"a TPOT budget must be positive, got {text!r}")
    return value


def substitution_config(args: argparse.Namespace):
    """The run's Substitution, or None (off). A TPOT budget turns it on (α tuned at start: 0 until then)."""
    from moetier.plan.substitute import Substitution

    text = args.substitute.strip().lower()
    if text == "similar":
        from moetier.plan.similar_substitute import SimilarSubstitution

        if getattr(args, "tpot_budget", None) is not None or args.substitute_weight != "scaled" \
                or not args.batch_aware:
            raise MoetierError("--substitute similar takes the replaced expert's weight and has no alpha to tune",
                               hint="drop --tpot-budget, --substitute-weight and --no-batch-aware (SMoE's options)")
        return SimilarSubstitution()
    if getattr(args, "tpot_budget", None) is not None:
        parse_seconds(args.tpot_budget)  # refused before any model is loaded
        if text not in ("off", "auto"):
            raise MoetierError("--tpot-budget chooses alpha itself", hint="leave out --substitute, or give no budget")
        return Substitution(0.0, args.substitute_weight, args.batch_aware)
    if text == "off":
        return None
    if text == "auto":
        alpha = None
    else:
        try:
            alpha = float(text)
        except ValueError:
            raise MoetierError(f"--substitute takes off, auto, similar or a number in [0, 1), got "
                               f"{args.substitute!r}") from None
    return Substitution(alpha, args.substitute_weight, args.batch_aware)


def add_prefetch_options(p: argparse.ArgumentParser) -> None:
    """Options of every command that can prefetch (docs/prediction.md)."""
    from moetier.plan.prefetchers import PREFETCHERS
    from moetier.predictor_names import BUILT_ON as PREDICTORS  # (the names alone: no torch to load for them)

    p.add_argument("--prefetch", default="none", choices=["none", *PREFETCHERS],
                   help="read experts the coming layers are predicted to need: hobbit (adaptive look-ahead), smoe "
                        "(top-score experts), comoe (probability threshold, Eq. 19), comoe-37 (Eq. 37's), presched "
                        "(as many as the gap fits)")
    p.add_argument("--predictor", default="none", choices=["none", *PREDICTORS],
                   help="what predicts the coming layers' experts (stacked-gates: the next layers' routers on the "
                        "current hidden state)")
    p.add_argument("--predict-distance", type=count(1, 1024), default=2,
                   help="MoE layers ahead to predict (HOBBIT's p)")


def add_parser(sub) -> None:
    from moetier.plan.placement import PLACEMENTS

    g = command(sub, "generate", "generate text with experts offloaded to disk")
    add_engine_options(g, "30%")
    add_precision_options(g)
    add_substitution_options(g)
    add_speculation_options(g)
    add_budget_option(g)
    g.add_argument("--prompt", action="append", help="prompt text; repeat for a batch; `-` reads stdin")
    g.add_argument("--prompt-file", action="append", help="a file whose text is one prompt; repeatable")
    g.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt, at most")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence (benchmarks)")
    g.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"expert eviction policy: {', '.join(LIVE_POLICIES)}; NAME+predicted spares what --predictor "
                        "names for the coming layers (`moetier list policies`, docs/cache-policies.md)")
    add_partition_option(g)
    add_prefetch_options(g)
    g.add_argument("--placement", default="none", choices=["none", *PLACEMENTS],
                   help="with --device cuda: per missing expert, read it into the GPU or compute it on the CPU from "
                        "host memory (every expert is kept there): smoe-two-pointer, prescope, greedy, hobbit-coop")
    add_sampling_options(g)
    g.add_argument("--reconvert", action="store_true",
                   help="convert a Hugging Face folder again even if the cache holds it (a damaged conversion)")
    g.add_argument("--json", action="store_true", help="print texts, token ids and statistics as JSON")
    g.set_defaults(func=_generate)
