"""`moetier convert` and `moetier synth`."""

from __future__ import annotations

import argparse
import dataclasses

from moetier.cli.defaults import SEED, command, count, finite
from moetier.errors import MoetierError
from moetier.store.synth_spec import PRESETS


def _convert(args: argparse.Namespace) -> None:
    from moetier.store.convert import convert
    from moetier.store.store import Store

    path = convert(args.hf_dir, args.store, overwrite=args.force, precisions=args.precisions or (), copy=args.copy)
    manifest = Store(path).manifest
    quantized = (manifest.config.get("quantization_config") or {}).get("quant_method")
    held = ", ".join(manifest.precisions) + (f" (dequantized from the checkpoint's {quantized})" if quantized else "")
    where = (f"; its {manifest.native_precision} experts are read from {args.hf_dir}'s files, which must stay there "
             f"unchanged (--copy copies them instead)" if manifest.sources else "")
    print(f"wrote {path}: {manifest.family}, experts held as {held}{where}")


def _quantize(args: argparse.Namespace) -> None:
    from moetier.resolve import resolve_model
    from moetier.store.variants import add_precisions

    store = resolve_model(args.store)
    added = add_precisions(store, args.precisions)
    print(f"{store}: added {', '.join(added)}" if added else f"{store} already holds {args.precisions}")


def _synth(args: argparse.Namespace) -> None:
    from moetier.store.synth import synthesize

    fields = {f.name for f in dataclasses.fields(PRESETS["olmoe-1b-7b"])}
    overrides = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if args.inflate is not None:
        return _inflate(args, sorted(set(overrides) - {"seed"}))
    if args.expert_intermediate is not None:
        raise MoetierError("--expert-intermediate sizes an inflated model", hint="give it with --inflate MODEL")
    spec = dataclasses.replace(PRESETS[args.preset or "olmoe-1b-7b"], **overrides)
    path = synthesize(spec, args.out, overwrite=args.force)
    print(f"wrote {path}")


def _inflate(args: argparse.Namespace, shape_options: list[str]) -> None:
    from moetier.resolve import resolve_model
    from moetier.store.inflate import inflate, intermediate_for
    from moetier.store.store import Store

    if shape_options or args.preset is not None:
        given = ", ".join("--" + o.replace("_", "-") for o in shape_options) or "--preset"
        raise MoetierError(f"{given} sets a random model's shape; an inflated model keeps MODEL's",
                           hint="give --inflate MODEL with --expert-intermediate (and --seed) only")
    store = resolve_model(args.inflate)
    n = args.expert_intermediate or intermediate_for(Store(store))
    path = inflate(store, args.out, n, overwrite=args.force, seed=args.seed or 0)
    print(f"wrote {path}")


def add_parser(sub) -> None:
    c = command(sub, "convert", "convert a Hugging Face MoE checkpoint into a moetier store")
    c.add_argument("hf_dir", help="the Hugging Face model folder (config.json, *.safetensors, tokenizer files)")
    c.add_argument("store", help="the store folder to write")
    c.add_argument("--force", action="store_true",
                   help="replace an existing store (only a moetier store; never the checkpoint itself)")
    c.add_argument("--precisions", metavar="LIST",
                   help="also write quantized copies of every expert, e.g. bf16,int8,int4 (int8, int4, int2; or GGML's "
                        "q8_0, q6_k, q5_k, q4_k, q4_k_m, mxfp4 — gpt-oss's own values in mxfp4)")
    c.add_argument("--copy", action="store_true",
                   help="copy the experts into the store (by default the store reads them from the checkpoint's "
                        "safetensors files, writing only the dense weights and an index)")
    c.set_defaults(func=_convert)

    q = command(sub, "quantize", "add quantized copies of every expert (int8, int4, int2; GGML's q8_0, q6_k, q5_k, "
                                 "q4_k, q4_k_m, mxfp4) to a store: atomic, and a killed run resumes where it stopped")
    q.add_argument("store", help="a store, or a built-in model's name (its store in the cache directory)")
    q.add_argument("--precisions", required=True, metavar="LIST",
                   help="e.g. int8,int4 (or int8,int2; or q4_k, fitted as llama-quantize fits it)")
    q.set_defaults(func=_quantize)

    s = command(sub, "synth", "write a synthetic store: a real shape with random weights, or (--inflate) a model's "
                              "own experts padded to a real expert's size")
    s.add_argument("out", help="the store folder to write")
    s.add_argument("--preset", choices=sorted(PRESETS), help="the shape to start from (default olmoe-1b-7b)")
    s.add_argument("--inflate", metavar="MODEL",
                   help="a model (built-in name, Hugging Face folder or store) whose experts get extra hidden units "
                        "that contribute exactly zero: same routing and tokens, real-size reads")
    s.add_argument("--expert-intermediate", dest="expert_intermediate", type=count(), metavar="N",
                   help="with --inflate: the experts' new intermediate size (default: OLMoE-1B-7B's 12 MiB expert)")
    for name in ("hidden_size", "num_layers", "num_experts", "intermediate_size", "top_k", "num_heads",
                 "num_kv_heads", "vocab_size", "seed"):
        s.add_argument("--" + name.replace("_", "-"), dest=name, type=SEED if name == "seed" else count(),
                       help=f"override the preset's {name}")
    s.add_argument("--precision", choices=["bf16", "fp16", "fp32"], help="override the preset's precision")
    s.add_argument("--embed-std", dest="embed_std", type=finite(0, 1e6),
                   help="standard deviation of the token embedding (large keeps routing near-uniform)")
    s.add_argument("--force", action="store_true", help="replace an existing store (only a moetier store)")
    s.set_defaults(func=_synth)
