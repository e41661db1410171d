"""`moetier convert` and `moetier synth`."""

from __future__ import annotations

import argparse
import dataclasses

from moetier.cli.defaults import command
from moetier.store.synth import PRESETS


def _convert(args: argparse.Namespace) -> None:
    from moetier.store.convert import convert

    path = convert(args.hf_dir, args.store, overwrite=args.force)
    print(f"wrote {path}")


def _synth(args: argparse.Namespace) -> None:
    from moetier.store.synth import synthesize

    fields = {f.name for f in dataclasses.fields(PRESETS[args.preset])}
    overrides = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    spec = dataclasses.replace(PRESETS[args.preset], **overrides)
    path = synthesize(spec, args.out, overwrite=args.force)
    print(f"wrote {path}")


def add_parser(sub) -> None:
    c = command(sub, "convert", "convert a Hugging Face MoE checkpoint into a moetier store")
    c.add_argument("hf_dir", help="the Hugging Face model folder (config.json, *.safetensors, tokenizer files)")
    c.add_argument("store", help="the store folder to write")
    c.add_argument("--force", action="store_true",
                   help="replace an existing store (only a moetier store; never the checkpoint itself)")
    c.set_defaults(func=_convert)

    s = command(sub, "synth", "write a synthetic store of real shape with random weights")
    s.add_argument("out", help="the store folder to write")
    s.add_argument("--preset", default="olmoe-1b-7b", choices=sorted(PRESETS), help="the shape to start from")
    for name in ("hidden_size", "num_layers", "num_experts", "intermediate_size", "top_k", "num_heads",
                 "num_kv_heads", "vocab_size", "seed"):
        s.add_argument("--" + name.replace("_", "-"), dest=name, type=int, help=f"override the preset's {name}")
    s.add_argument("--precision", choices=["bf16", "fp16", "fp32"], help="override the preset's precision")
    s.add_argument("--embed-std", dest="embed_std", type=float,
                   help="standard deviation of the token embedding (large keeps routing near-uniform)")
    s.add_argument("--force", action="store_true", help="replace an existing store (only a moetier store)")
    s.set_defaults(func=_synth)
