"""Decode speed with experts offloaded to disk, against two bounds measured in the same run.

On a synthetic model of OLMoE-1B-7B's shape (hidden 2048, 16 layers, 64 experts of intermediate 1024, top-8,
bf16 random weights; made with `moetier synth` if missing), for each expert budget: TPOT, expert bytes read
per token, hit rate, peak RSS. Bounds: compute-only (every expert resident, no cache machinery) and I/O
(bytes read per token / the disk's O_DIRECT read bandwidth, measured before and after the runs with the
engine's own reader). Each configuration runs in a fresh process so its peak RSS is its own.

    python bench/bench_offload.py                  # table on stdout, JSON + PNG in bench/out/
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from common import add_run_options, run_child  # noqa: E402

from moetier.paths import default_cache_dir  # noqa: E402

DEFAULT_STORE = default_cache_dir() / "bench" / "olmoe-1b-7b-synth"


def child(cfg: dict) -> dict:
    """One configuration, in its own process."""
    import torch

    from moetier import Engine

    sys.path.insert(0, str(ROOT))
    from resident_experts import ResidentExperts

    engine = Engine.from_pretrained(cfg["store"], expert_memory=cfg["budget"], policy=cfg["policy"], progress=False)
    spec = engine.spec
    rng = random.Random(cfg["seed"])
    warm_prompt = [rng.randrange(spec.vocab_size) for _ in range(cfg["prompt_len"])]
    prompt = [rng.randrange(spec.vocab_size) for _ in range(cfg["prompt_len"])]
    if cfg["budget"] == "100%":
        engine.preload()  # everything fits: start with the whole model resident
    if cfg["mode"] == "compute-only":
        engine.model.experts = ResidentExperts(engine.executor)
        engine.executor = engine.model.experts  # generate() drives whatever executes the experts
    run = engine.generate if cfg["mode"] == "cache" else None
    from moetier.engine.generate import generate
    from moetier.engine.sampling import SamplingParams

    def once(p: list[int], n: int) -> dict:
        if run is not None:
            return run([p], max_new_tokens=n, ignore_eos=True).stats
        _, stats = generate(engine.model, engine.executor, [p], SamplingParams(n))
        return stats.summary()

    once(warm_prompt, cfg["warmup_tokens"])  # reach the cache's steady state
    stats = once(prompt, cfg["tokens"])
    max_len = cfg["prompt_len"] + cfg["tokens"]
    kv_bytes = 2 * spec.num_layers * spec.num_kv_heads * max_len * spec.head_dim * torch.finfo(
        engine.model.dtype).bits // 8
    stats.update(kv_bytes=kv_bytes, dense_bytes=engine.dense_bytes,
                 expert_cache_bytes=getattr(engine.executor, "pool", None) and engine.executor.pool.nbytes
                 or engine.store.total_expert_bytes())
    engine.close()
    return stats


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["budget"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.27 for i in x], [r["tpot_s"] * 1e3 for r in rows], 0.27, label="TPOT (measured)")
    ax.bar(list(x), [r["compute_only_s"] * 1e3 for r in rows], 0.27, label="compute-only bound")
    ax.bar([i + 0.27 for i in x], [r["io_bound_s"] * 1e3 for r in rows], 0.27, label="I/O bound")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("expert budget (share of all expert bytes)")
    ax.set_ylabel("ms per output token")
    ax.set_title("moetier decode, OLMoE-1B-7B shape, LRU, experts on disk (O_DIRECT)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(ap)
    ap.add_argument("--store", type=Path, default=DEFAULT_STORE)
    ap.add_argument("--reader-threads", type=int, default=4)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return

    if not (args.store / "manifest.json").exists():
        print(f"writing the synthetic model to {args.store} (about 13 GB) ...", file=sys.stderr)
        subprocess.run(["moetier", "synth", str(args.store), "--preset", "olmoe-1b-7b"], check=True)
    base = dict(store=str(args.store), policy=args.policy, tokens=args.tokens, warmup_tokens=args.warmup_tokens,
                prompt_len=args.prompt_len, seed=0)
    from tqdm import tqdm

    from moetier.calibrate import read_bandwidth
    from moetier.store.store import Store

    budgets = args.budgets.split(",")
    bar = tqdm(total=len(budgets) + 3, desc="bench", unit="run")
    bw_before = read_bandwidth(Store(args.store), args.reader_threads)
    bar.update()
    compute_only = run_child(__file__, dict(base, budget="100%", mode="compute-only"))
    bar.update()
    results = []
    for budget in budgets:
        results.append(dict(budget=budget, **run_child(__file__, dict(base, budget=budget, mode="cache"))))
        bar.update()
    bw_after = read_bandwidth(Store(args.store), args.reader_threads)
    bar.update()
    bar.close()
    bandwidth = (bw_before + bw_after) / 2

    rows = []
    for r in results:
        io_bound = r["expert_bytes_per_token"] / bandwidth
        bound = max(compute_only["tpot_s"], io_bound)
        accounted = r["expert_cache_bytes"] + r["dense_bytes"] + r["kv_bytes"]
        rows.append(dict(budget=r["budget"], tpot_s=r["tpot_s"], tpot_p50_s=r["tpot_p50_s"],
                         tpot_p90_s=r["tpot_p90_s"], ttft_s=r["ttft_s"], hit_rate=r["decode_hit_rate"],
                         expert_bytes_per_token=r["expert_bytes_per_token"], compute_only_s=compute_only["tpot_s"],
                         io_bound_s=io_bound, ratio_to_bound=r["tpot_s"] / bound, peak_rss_bytes=r["peak_rss_bytes"],
                         expert_cache_bytes=r["expert_cache_bytes"], dense_bytes=r["dense_bytes"],
                         kv_bytes=r["kv_bytes"], rss_overhead_bytes=r["peak_rss_bytes"] - accounted))
    report = dict(store=str(args.store), policy=args.policy, tokens=args.tokens, warmup_tokens=args.warmup_tokens,
                  prompt_len=args.prompt_len, read_bandwidth_before=bw_before, read_bandwidth_after=bw_after,
                  compute_only=compute_only, rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offload.json").write_text(json.dumps(report, indent=1))
    plot(rows, args.out / "offload.png")

    print(f"O_DIRECT read bandwidth: {bw_before / 1e9:.2f} GB/s before, {bw_after / 1e9:.2f} GB/s after")
    print(f"compute-only TPOT: {compute_only['tpot_s'] * 1e3:.1f} ms (all experts resident, no cache machinery)")
    print(f"{'budget':>7} {'TPOT ms':>8} {'p90 ms':>7} {'hit':>6} {'MiB/tok':>8} {'I/O ms':>7} {'ratio':>6} "
          f"{'RSS MiB':>8} {'overhead MiB':>12}")
    for r in rows:
        print(f"{r['budget']:>7} {r['tpot_s'] * 1e3:8.1f} {r['tpot_p90_s'] * 1e3:7.1f} {r['hit_rate']:6.1%} "
              f"{r['expert_bytes_per_token'] / 2**20:8.1f} {r['io_bound_s'] * 1e3:7.1f} {r['ratio_to_bound']:6.2f} "
              f"{r['peak_rss_bytes'] / 2**20:8.0f} {r['rss_overhead_bytes'] / 2**20:12.0f}")
    print(f"wrote {args.out / 'offload.json'} and {args.out / 'offload.png'}")


if __name__ == "__main__":
    main()
