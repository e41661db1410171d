"""What the benchmarks share: the measurement options, and one configuration per fresh process (so each
one's peak RSS and caches are its own)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def add_run_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--budgets", default="100%,50%,25%")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--tokens", type=int, default=32, help="measured tokens")
    ap.add_argument("--warmup-tokens", type=int, default=16, help="tokens generated first to warm the cache")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--out", type=Path, default=OUT)


def run_child(script: str, cfg: dict) -> dict:
    """Run `script --child CFG` in a fresh interpreter; its last stdout line is the JSON result."""
    out = subprocess.run([sys.executable, script, "--child", json.dumps(cfg)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"configuration {cfg} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])
