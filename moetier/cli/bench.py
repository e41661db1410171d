"""`moetier bench`: prompt processing and generation speed as llama-bench reports them (pp512, tg128: tokens/s,
mean ± standard deviation over the repetitions), so a model's numbers sit beside `llama-bench`'s on the same file."""

from __future__ import annotations

import argparse
import json
import sys

from moetier.cli.defaults import command, count
from moetier.cli.generate import (
    add_engine_options,
    add_precision_options,
    check_engine_args,
    open_engine,
    precision_config,
)
from moetier.config import format_bytes
from moetier.errors import MoetierError


def token_counts(text: str) -> list[int]:
    """An argparse type: comma-separated whole numbers (llama-bench's `-p 128,512`); 0 runs no such test."""
    try:
        counts = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated whole numbers (e.g. 128,512)") from None
    if min(counts) < 0:
        raise argparse.ArgumentTypeError(f"token counts are 0 (no test) or more, got {text}")
    return counts


def speed_tests(args: argparse.Namespace) -> list:
    from moetier.engine.speed import SpeedTest

    tests = [SpeedTest("pp", n) for n in args.prompt_tokens if n] + [SpeedTest("tg", n, args.batch)
                                                                     for n in args.gen_tokens if n]
    if not tests:
        raise MoetierError("no test to run: every count is 0", hint="-p 512 (a prompt), -n 128 (generation)")
    return tests


def check_context(model: str, tests: list) -> None:
    """Each test's tokens within the model's context window (config.json alone), before anything loads: a pp test's
    prompt and the token it samples, a tg test's one-token prompt, the token its prefill samples and the N timed."""
    from moetier.model_info import inspect_model

    window = inspect_model(model).spec.max_position_embeddings
    need, test = max((t.tokens + (1 if t.kind == "pp" else 2), t.name) for t in tests)
    if window and need > window:
        raise MoetierError(f"{test} needs {need} tokens of context; the model's context window is {window}",
                           hint=f"-p at most {window - 1}, -n at most {window - 2}")


def kernels_name(engine) -> str:
    isa = getattr(engine.kernels, "isa", "")
    return f"native {isa}" if isa else type(engine.kernels).__name__.removesuffix("Kernels").lower() or "torch"


def table(header: dict, results: list) -> str:
    """llama-bench's markdown table: what ran, then a row a test."""
    cols = [*header, "test", "t/s"]
    rows = [[*map(str, header.values()), r.test.name, f"{r.mean:.2f} ± {r.std:.2f}"] for r in results]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    right = {len(cols) - 1}  # (numbers right-aligned, as llama-bench's)
    line = lambda cells: "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)  # noqa: E731
                                           for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    rule = "| " + " | ".join("-" * (w - 1) + (":" if i in right else "-") for i, w in enumerate(widths)) + " |"
    return "\n".join([line(cols), rule, *map(line, rows)])


def _bench(args: argparse.Namespace) -> None:
    tests = speed_tests(args)
    check_engine_args(args)
    check_context(args.model, tests)
    import torch

    from moetier.engine.speed import measure
    from moetier.progress import tqdm

    engine = open_engine(args, progress=not args.json, precision=precision_config(args),
                         dense_precision=args.dense_precision)
    with engine, tqdm(total=len(tests) * (1 + args.repetitions), desc="bench", unit="run",
                      disable=args.json) as bar:
        results = [measure(engine, t, args.repetitions, seed=args.seed, on_sample=lambda: bar.update(1))
                   for t in tests]
        header = {"model": args.model,
                  "expert cache": f"{format_bytes(engine.budget.cache_bytes)} ({engine.budget.slots} experts)",
                  "precision": args.precision, "kernels": kernels_name(engine), "threads": torch.get_num_threads()}
    if args.json:
        print(json.dumps({**header, "repetitions": args.repetitions, "rows": [r.row() for r in results]}, indent=1))
    else:
        print(table(header, results))
    sys.stdout.flush()


def add_parser(sub) -> None:
    b = command(sub, "bench", "prompt and generation speed as llama-bench measures them (pp512, tg128)")
    add_engine_options(b, "auto")
    add_precision_options(b)
    b.add_argument("-p", "--prompt-tokens", type=token_counts, default=[512],
                   help="prompt lengths to time, comma-separated (llama-bench's -p; 0: none)")
    b.add_argument("-n", "--gen-tokens", type=token_counts, default=[128],
                   help="tokens to generate and time, comma-separated (llama-bench's -n; 0: none)")
    b.add_argument("-r", "--repetitions", type=count(1, 1000), default=5,
                   help="measured runs of each test, after one to warm (llama-bench's -r)")
    b.add_argument("-b", "--batch", type=count(1, 256), default=1,
                   help="sequences a tg test decodes together, tokens/s over all of them (llama-batched-bench's S_TG)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    b.add_argument("--json", action="store_true", help="print the results as JSON")
    b.set_defaults(func=_bench)
