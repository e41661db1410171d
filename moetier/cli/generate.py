"""`moetier generate`."""

from __future__ import annotations

import argparse
import json
import sys

from moetier.cache.policies import POLICIES
from moetier.cli.defaults import DEFAULT_MODEL


def _generate(args: argparse.Namespace) -> None:
    from moetier.engine.engine import Engine
    from moetier.engine.stats import format_summary

    engine = Engine.from_pretrained(args.model, expert_memory=args.expert_memory, policy=args.policy,
                                    cache_dir=args.cache_dir, progress=not args.json,
                                    reader_threads=args.reader_threads, cache_partition=args.cache_partition)
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


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text with experts offloaded to disk")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="Hugging Face folder, converted store, or built-in model name (default %(default)s)")
    g.add_argument("--prompt", action="append", required=True, help="repeat for a batch of prompts")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--expert-memory", default="30%", help="bytes (512MiB, 2GB), share of expert bytes (30%%), auto")
    g.add_argument("--policy", default="lru", choices=sorted(POLICIES), help="expert eviction policy (see "
                   "docs/cache-policies.md; belady is offline only)")
    g.add_argument("--cache-partition", default="global", choices=["global", "per-layer"],
                   help="one expert cache for all layers, or the slots split evenly among them")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cache-dir", help="where Hugging Face folders are converted (default ~/.cache/moetier)")
    g.add_argument("--reader-threads", type=int, default=4)
    g.add_argument("--json", action="store_true", help="print texts and statistics as JSON")
    g.set_defaults(func=_generate)
