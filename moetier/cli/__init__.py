"""The `moetier` command: one module per command group, each adding its parsers."""

from __future__ import annotations

import argparse
import sys

from moetier.cli import cache, generate, sim, store, trace
from moetier.errors import MoetierError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moetier", description="Run Mixture-of-Experts language models on machines too small to hold all "
                                    "their experts: experts stay on disk, a bounded cache holds the ones in use.")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (generate, store, trace, sim, cache):
        group.add_parser(sub)
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

