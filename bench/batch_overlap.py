"""How much a decode batch can share of its experts, from real routing: B sequences decoding together need the
union of their tokens' experts in each layer, so the expert bytes a step reads (or streams from memory) per
token fall by B·k / E|union| at most — before any cache, whatever the scheduler does.

Measured on the real traces in ../shared/data/traces (each a model trained at scale: Mixtral-8x7B, Qwen1.5-MoE,
OLMoE): for each B, many draws of B tokens, each from a different sequence at a random position (a trace of fewer
than 8 sequences — OLMoE's is one stream of 25 questions — cut into pieces of 128 tokens, each standing for a
sequence); beside each, what uniform routing would give (B·k / (E·(1 − (1 − k/E)^B))).

    python bench/batch_overlap.py
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import OUT  # noqa: E402

TRACES = ROOT.parent / "shared" / "data" / "traces"
PIECE = 128  # tokens: a trace of fewer than 8 sequences is cut into pieces this long, each standing for one


def real_traces() -> dict[str, tuple[int, int, dict]]:
    """name -> (num_experts, top_k, {(sequence, layer): [[ids] per token]})."""
    out = {}
    for name, files, experts, k, seq_key in [
        ("Mixtral-8x7B (8, top-2)", sorted((TRACES / "mixtral-8x7b").glob("*.jsonl")), 8, 2, "problem_id"),
        ("Qwen1.5-MoE (60, top-4)", sorted((TRACES / "qwen1.5-moe-a2.7b").glob("*.jsonl")), 60, 4, "req_id"),
        ("OLMoE-1B-7B (64, top-8)", sorted((TRACES / "olmoe-1b-7b").glob("*.jsonl")), 64, 8, "req_id"),
    ]:
        routes = defaultdict(list)
        for f in files:
            part, last = defaultdict(int), {}  # a token index that does not grow starts a new sequence
            for line in f.read_text().splitlines():
                r = json.loads(line)
                if r.get("type", "route") != "route":
                    continue
                where = (r[seq_key], r["layer"])
                if r["token_idx"] <= last.get(where, -1):
                    part[where] += 1
                last[where] = r["token_idx"]
                ids = r.get("topk_ids", r.get("experts"))
                routes[(f"{f.name}:{r[seq_key]}:{part[where]}", r["layer"])].append(ids)
        if len({seq for seq, _ in routes}) < 8:  # (OLMoE's trace is one stream of 25 questions): pieces of 128
            routes = {(f"{seq}/{i}", layer): tokens[i:i + PIECE] for (seq, layer), tokens in routes.items()
                      for i in range(0, len(tokens), PIECE) if len(tokens) - i >= PIECE // 2}
        if routes:
            out[name] = (experts, k, dict(routes))
    return out


def union_ratio(experts: int, k: int, routes: dict, batch: int, draws: int, rng) -> float:
    """Mean over draws and layers of (B·k) / |union of the B tokens' experts|."""
    by_layer = defaultdict(list)
    for (_, layer), tokens in routes.items():
        by_layer[layer].append(tokens)
    ratios = []
    for seqs in by_layer.values():
        if len(seqs) < batch:
            continue
        for _ in range(draws):
            chosen = rng.choice(len(seqs), batch, replace=False)
            union = set()
            for s in chosen:
                union.update(seqs[s][rng.integers(len(seqs[s]))])
            ratios.append(batch * k / len(union))
    return float(np.mean(ratios)) if ratios else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="2,4,8")
    ap.add_argument("--draws", type=int, default=400)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    batches = [int(b) for b in args.batches.split(",")]
    rows = {}
    for name, (experts, k, routes) in real_traces().items():
        rows[name] = {b: union_ratio(experts, k, routes, b, args.draws, rng) for b in batches}
        uniform = {b: b * k / (experts * (1 - (1 - k / experts) ** b)) for b in batches}
        rows[f"{name}, uniform routing"] = uniform
    print(f"{'expert reads a token saves in a batch of':42}" + "".join(f"{f'B={b}':>9}" for b in batches))
    for name, r in rows.items():
        print(f"{name:42}" + "".join(f"{r[b]:8.2f}×" for b in batches))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "batch_overlap.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
