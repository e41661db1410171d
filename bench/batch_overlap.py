"""How much a decode batch can share of its experts, from real routing: B sequences decoding together need the
union of their tokens' experts in each layer, so the expert bytes a step reads (or streams from memory) per
token fall by B·k / E|union| at most — before any cache, whatever the scheduler does.

Measured on the real traces in data/traces (each a model trained at scale: Mixtral-8x7B, Qwen1.5-MoE,
OLMoE): for each B, many draws of B tokens, each from a different sequence at a random position (a trace of fewer
than 8 sequences — OLMoE's is one stream of 25 questions — cut into pieces of 128 tokens, each standing for a
sequence); beside each, what uniform routing would give (B·k / (E·(1 − (1 − k/E)^B))).

With a cache (`--cache 25%`, a share of the traced experts, one pool for every layer), the second table replays the same sequences
through it one at a time (one after another, the cache carried over, as a server serving one request at a time)
and in batches (B sequences in lock step, each step reading its layer's union), under LRU, LFU and Belady's MIN
(the offline optimum: no policy reads less). A trace whose tokens mostly route as the one before (a generation
repeating itself) is left out of this table: any cache holds it. Reads per token one at a time (LRU) over reads per token batched
(Belady) bounds what batching can gain where reads bound the step, whatever the policy.

    python bench/batch_overlap.py
    python bench/batch_overlap.py --record demo-deep    # also the served model's routing on bench_serve.py's prompts
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import OUT  # noqa: E402
from train.corpus import VALID_BOOKS, prompt_lines  # noqa: E402

TRACES = ROOT / "data" / "traces"  # the real traces, shipped in the repository
PIECE = 128  # tokens: a trace of fewer than 8 sequences is cut into pieces this long, each standing for one


def real_traces() -> dict[str, tuple[int, int, dict]]:
    """name -> (num_experts, top_k, {(sequence, layer): [[ids] per token]})."""
    out = {}
    for name, files, experts, k, seq_key in [
        ("Mixtral-8x7B (8, top-2)", sorted((TRACES / "mixtral-8x7b").glob("*.jsonl.gz")), 8, 2, "problem_id"),
        ("Qwen1.5-MoE (60, top-4)", sorted((TRACES / "qwen1.5-moe-a2.7b").glob("*.jsonl.gz")), 60, 4, "req_id"),
        ("OLMoE-1B-7B (64, top-8)", sorted((TRACES / "olmoe-1b-7b").glob("*.jsonl.gz")), 64, 8, "req_id"),
    ]:
        routes = defaultdict(list)
        for f in files:
            part, last = defaultdict(int), {}  # a token index that does not grow starts a new sequence
            for line in gzip.open(f, "rt").read().splitlines():
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


def trace_sequences(path: Path) -> tuple[str, int, int, dict]:
    """A moetier trace's decode tokens (`moetier trace record`): (name, num_experts, top_k, {(seq, layer): [[ids]
    per token]}) — the routing of the very model and prompts a serving benchmark runs."""
    from moetier.plan.route import DECODE
    from moetier.trace.format import Trace

    t = Trace.load(path)
    routes = defaultdict(list)
    for row in np.flatnonzero(t.phase == DECODE):
        for col, layer in enumerate(t.layers):
            routes[(str(int(t.seq[row])), layer)].append(t.topk_ids[row, col].tolist())
    return f"{t.model} (trace {path.name})", t.num_experts, t.top_k, dict(routes)


def record(model: str, out: Path, prompts: int, tokens: int) -> Path:
    """`moetier trace record` of `model` on the first `prompts` of bench_serve.py's prompts (its requests at
    concurrency 8), `tokens` each, greedy: the routing the serving benchmark's batches meet."""
    out.mkdir(parents=True, exist_ok=True)
    lines = out / f"{model}-serve-prompts.txt"
    lines.write_text("\n".join(prompt_lines(list(VALID_BOOKS), 64, words=40)[:prompts]) + "\n")
    trace = out / f"{model}-serve-trace"
    subprocess.run([sys.executable, "-m", "moetier.cli", "trace", "record", "--model", model, "--prompts", str(lines),
                    "--out", str(trace), "--max-tokens", str(tokens), "--force"], check=True)
    return trace


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


def sequences(routes: dict) -> dict[str, dict[int, list]]:
    """{sequence: {layer: [[ids] per token]}}, each cut to the tokens every layer of it has."""
    out: dict = defaultdict(dict)
    for (seq, layer), tokens in routes.items():
        out[seq][layer] = tokens
    return {seq: {layer: t[:min(len(v) for v in layers.values())] for layer, t in layers.items()}
            for seq, layers in sorted(out.items())}


def steps(seqs: dict[str, dict[int, list]], batch: int):
    """Each decode step's union per layer, in order: groups of `batch` sequences in lock step (a group runs as
    long as its shortest member; groups one after another), layers in ascending order."""
    names = list(seqs)
    for g in range(0, len(names) - batch + 1, batch):
        group = [seqs[n] for n in names[g:g + batch]]
        layers = sorted(set.intersection(*(set(s) for s in group)))
        if not layers:
            continue
        for t in range(min(len(s[layer]) for s in group for layer in layers)):
            yield [(layer, sorted({e for s in group for e in s[layer][t]})) for layer in layers], batch


def cache_reads(seqs: dict[str, dict[int, list]], batch: int, slots: int, policy: str) -> float:
    """Expert reads per token through one cache of `slots` experts shared by every layer (as the engine's pool),
    under "lru", "lfu" (counts kept across sequences) or "belady" (evict the expert used again farthest ahead).
    A layer's union larger than the cache streams through it: an expert used in this step may be evicted once it
    has been computed, never one still to come if another can go."""
    accesses = [(layer, ids, b) for step, b in steps(seqs, batch) for layer, ids in step]
    uses: dict = defaultdict(list)  # (layer, expert) -> the indices of the accesses that need it
    for i, (layer, ids, _) in enumerate(accesses):
        for e in ids:
            uses[(layer, e)].append(i)
    cache: dict = {}  # (layer, expert) -> its score now (the lowest is evicted)
    count: dict = defaultdict(int)
    reads = tokens = 0
    for i, (layer, ids, b) in enumerate(accesses):
        for n, e in enumerate(ids):
            key = (layer, e)
            count[key] += 1
            if key not in cache:
                reads += 1
                if len(cache) >= slots:
                    coming = {(layer, x) for x in ids[n:]}
                    pool = [x for x in cache if x not in coming] or list(cache)
                    del cache[min(pool, key=cache.__getitem__)]
            if policy == "lru":
                cache[key] = i
            elif policy == "lfu":
                cache[key] = count[key]
            else:  # belady: minus the next use after this one (an expert's next use moves only when it is used)
                later = uses[key]
                j = bisect.bisect_right(later, i)
                cache[key] = -(later[j] if j < len(later) else float("inf"))
        if layer == accesses[0][0]:
            tokens += b
    return reads / tokens


def repeats(routes: dict) -> float:
    """The share of consecutive tokens of a sequence that route exactly as the one before (a generation that
    repeats itself: Qwen1.5-MoE's trace, 67%)."""
    same = pairs = 0
    for tokens in routes.values():
        same += sum(a == b for a, b in zip(tokens, tokens[1:]))
        pairs += max(0, len(tokens) - 1)
    return same / pairs if pairs else 0.0


def plot(cached: dict, batch: int, cache: str, path: Path) -> None:
    """Reads a token per policy, one at a time beside batched, a panel per trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cached), figsize=(4.5 * len(cached), 3.6), squeeze=False)
    for ax, (name, r) in zip(axes[0], cached.items()):
        policies = ("lru", "lfu", "belady")
        x = np.arange(len(policies))
        ax.bar(x - 0.2, [r[f"{p}, B=1"] for p in policies], 0.4, label="one at a time")
        ax.bar(x + 0.2, [r[f"{p}, B={batch}"] for p in policies], 0.4, label=f"batch of {batch}")
        ax.set_xticks(x, ["LRU", "LFU", "Belady (optimum)"])
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("expert reads per token")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"a cache of {cache} of the experts", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="2,4,8")
    ap.add_argument("--draws", type=int, default=400)
    ap.add_argument("--trace", type=Path, action="append", default=[],
                    help="also a moetier trace's decode tokens (`moetier trace record`), e.g. the served model's")
    ap.add_argument("--record", action="append", default=[], metavar="MODEL",
                    help="record MODEL's routing on bench_serve.py's prompts (16 of them, 32 tokens) and add it")
    ap.add_argument("--cache", default="25%", help="the cache as a share of the traced experts")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    batches = [int(b) for b in args.batches.split(",")]
    rows = {}
    traces = real_traces()
    for path in args.trace + [record(m, args.out, 16, 32) for m in args.record]:
        name, experts, k, routes = trace_sequences(path)
        traces[name] = (experts, k, routes)
    for name, (experts, k, routes) in traces.items():
        rows[name] = {b: union_ratio(experts, k, routes, b, args.draws, rng) for b in batches}
        uniform = {b: b * k / (experts * (1 - (1 - k / experts) ** b)) for b in batches}
        rows[f"{name}, uniform routing"] = uniform
    print(f"{'expert reads a token saves in a batch of':42}" + "".join(f"{f'B={b}':>9}" for b in batches))
    for name, r in rows.items():
        print(f"{name:42}" + "".join(f"{r[b]:8.2f}×" for b in batches))
    share = float(args.cache.rstrip("%")) / 100
    cached = {}
    print(f"\nexpert reads a token, a cache of {args.cache} of the experts: one at a time / batch of "
          f"{max(batches)}")
    for name, (experts, k, routes) in traces.items():
        if repeats(routes) > 0.5:
            print(f"{name:42}skipped: {repeats(routes):.0%} of its tokens route as the one before")
            continue
        seqs = sequences(routes)
        slots = max(k, round(share * experts * len({layer for _, layer in routes})))
        if len(seqs) < max(batches):
            continue
        cached[name] = {f"{p}, B={b}": cache_reads(seqs, b, slots, p) for p in ("lru", "lfu", "belady")
                        for b in (1, max(batches))}
        r = cached[name]
        bound = r["lru, B=1"] / r[f"belady, B={max(batches)}"]
        print(f"{name:42}" + "  ".join(f"{p} {r[f'{p}, B=1']:.2f} / {r[f'{p}, B={max(batches)}']:.2f}"
                                         for p in ("lru", "lfu", "belady")) + f"   bound {bound:.2f}×")
    args.out.mkdir(parents=True, exist_ok=True)
    if cached:
        plot(cached, max(batches), args.cache, args.out / "batch_cache_bound.png")
    (args.out / "batch_overlap.json").write_text(json.dumps({"union": rows, "cache": args.cache, "cached": cached},
                                                            indent=1))


if __name__ == "__main__":
    main()
