"""The `moetier` command: one module per command group, each adding its parsers."""

from __future__ import annotations

import argparse
import os
import sys

from moetier import __version__
from moetier.cli import bench, cache, evaluate, generate, listing, merge, predict, serve, sim, store, trace
from moetier.cli.defaults import HELP, Parser
from moetier.errors import MoetierError, one_line

SIGPIPE_EXIT = 141  # 128 + SIGPIPE: what `yes | head -1` gives a shell


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="moetier", formatter_class=HELP,
        description="Run Mixture-of-Experts language models on machines too small to hold all their experts: "
                    "experts stay on disk, a bounded cache holds the ones in use.")
    parser.add_argument("--version", action="version", version=f"moetier {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (generate, serve, bench, evaluate, store, merge, trace, sim, cache, predict, listing):
        group.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version (0), or argparse's one-line refusal (1): its status, returned
        return e.code if isinstance(e.code, int) else 1
    except MoetierError as e:  # an option's own check (`--model`: what it names is missing) with its hint
        print(f"moetier: error: {e}", file=sys.stderr)
        return 1
    try:
        args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
    except MoetierError as e:
        print(f"moetier: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return SIGPIPE_EXIT
    except OSError as e:  # a path the checks before the work did not foresee (a folder where a file goes, ...)
        print(f"moetier: error: {one_line(f'{e.strerror or e}' + (f': {e.filename}' if e.filename else ''))}\n"
              f"  hint: check the path and the disk", file=sys.stderr)
        return 1
    except MemoryError:
        print("moetier: error: out of memory\n  hint: smaller sizes, or free memory", file=sys.stderr)
        return 1
    return 0
