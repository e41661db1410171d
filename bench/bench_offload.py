"""Decode speed with experts offloaded to disk, against two bounds measured in the same run.

Models, every one with experts of OLMoE's 12 MiB:
- `olmoe-1b-7b-synth`: OLMoE-1B-7B's shape (hidden 2048, 16 layers, 64 experts of intermediate 1024, top-8)
  with random bf16 weights (made with `moetier synth` if missing): real size, routing near uniform;
- `demo-fine-xl`, `demo-deep-xl`: the trained demo models with their experts inflated to 12 MiB (same tokens,
  built on first use): real size AND real routing, prompted with real text.
For each model and expert budget: TPOT, expert bytes read per token, hit rate, peak RSS. Bounds: compute-only
(every expert resident, no cache machinery) and I/O (bytes read per token / the disk's O_DIRECT read bandwidth,
measured before and after each model's runs with the engine's own reader). Each configuration runs in a fresh
process so its peak RSS is its own.

    python bench/bench_offload.py                  # table on stdout, JSON + PNG in bench/out/
    python bench/bench_offload.py --models demo-fine-xl --budgets 50%,25%
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
from common import add_run_options, model_panels, run_child, save_panels  # noqa: E402

from moetier.paths import default_cache_dir  # noqa: E402

SYNTH = "olmoe-1b-7b-synth"
SYNTH_STORE = default_cache_dir() / "bench" / SYNTH
MODELS = (SYNTH, "demo-fine-xl", "demo-deep-xl")
PROMPTS = ROOT / "prompts" / "mixed.txt"  # warm-up on the first, measure on the others in turn


def prompts(engine, cfg: dict) -> tuple[list[int], list[int]]:
    """(warm-up, measured) prompts: random ids for the random-weight model, real text for trained ones (their
    routing is only real on text like what they learned)."""
    if cfg["random_prompts"]:
        rng = random.Random(cfg["seed"])
        return tuple([rng.randrange(engine.spec.vocab_size) for _ in range(cfg["prompt_len"])] for _ in range(2))
    lines = [line for line in PROMPTS.read_text().splitlines() if line.strip()]
    return engine.tokenizer.encode(lines[0]), engine.tokenizer.encode(" ".join(lines[1:]))[:cfg["prompt_len"]]


def child(cfg: dict) -> dict:
    """One configuration, in its own process."""
    import torch

    from moetier import Engine

    sys.path.insert(0, str(ROOT))
    from resident_experts import ResidentExperts

    engine = Engine.from_pretrained(cfg["store"], expert_memory=cfg["budget"], policy=cfg["policy"], progress=False)
    spec = engine.spec
    warm_prompt, prompt = prompts(engine, cfg)
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
    max_len = len(prompt) + cfg["tokens"]
    kv_bytes = 2 * spec.num_layers * spec.num_kv_heads * max_len * spec.head_dim * torch.finfo(
        engine.model.dtype).bits // 8
    stats.update(kv_bytes=kv_bytes, dense_bytes=engine.dense_bytes,
                 expert_cache_bytes=getattr(engine.executor, "pool", None) and engine.executor.pool.nbytes
                 or engine.store.total_expert_bytes())
    engine.close()
    return stats


def plot(rows: list[dict], path: Path) -> None:
    fig, panels = model_panels(rows, 4.2, 4)
    for ax, model, mine in panels:
        x = range(len(mine))
        ax.bar([i - 0.27 for i in x], [r["tpot_s"] * 1e3 for r in mine], 0.27, label="TPOT (measured)")
        ax.bar(list(x), [r["compute_only_s"] * 1e3 for r in mine], 0.27, label="compute-only bound")
        ax.bar([i + 0.27 for i in x], [r["io_bound_s"] * 1e3 for r in mine], 0.27, label="I/O bound")
        ax.set_xticks(list(x), [f"{r['budget']}\nhit {r['hit_rate']:.0%}" for r in mine])
        ax.set_title(model)
        ax.set_xlabel("expert budget")
    save_panels(fig, "moetier decode, LRU, 12 MiB experts on disk (O_DIRECT)", path)


def store_of(model: str) -> Path:
    """The store a model name stands for, made (with progress) if missing."""
    if model == SYNTH:
        if not (SYNTH_STORE / "manifest.json").exists():
            print(f"writing the synthetic model to {SYNTH_STORE} (about 13 GB) ...", file=sys.stderr)
            subprocess.run(["moetier", "synth", str(SYNTH_STORE), "--preset", "olmoe-1b-7b"], check=True)
        return SYNTH_STORE
    from moetier.resolve import resolve_model

    return resolve_model(model)


def bench_model(model: str, args, bar) -> tuple[dict, list[dict]]:
    """Bandwidth, compute-only bound and every budget of one model: (its summary, its rows)."""
    from moetier.calibrate import disk_tier
    from moetier.store.store import Store

    store = store_of(model)
    base = dict(store=str(store), policy=args.policy, tokens=args.tokens, warmup_tokens=args.warmup_tokens,
                prompt_len=args.prompt_len, seed=0, random_prompts=model == SYNTH)
    bw_before = disk_tier(Store(store), args.reader_threads).bandwidth_bytes_per_s
    compute_only = run_child(__file__, dict(base, budget="100%", mode="compute-only"))
    bar.update()
    results = []
    for budget in args.budgets.split(","):
        results.append(dict(budget=budget, **run_child(__file__, dict(base, budget=budget, mode="cache"))))
        bar.update()
    bw_after = disk_tier(Store(store), args.reader_threads).bandwidth_bytes_per_s
    bandwidth = (bw_before + bw_after) / 2
    rows = []
    for r in results:
        io_bound = r["expert_bytes_per_token"] / bandwidth
        bound = max(compute_only["tpot_s"], io_bound)
        accounted = r["expert_cache_bytes"] + r["dense_bytes"] + r["kv_bytes"]
        rows.append(dict(model=model, budget=r["budget"], tpot_s=r["tpot_s"], tpot_p50_s=r["tpot_p50_s"],
                         tpot_p90_s=r["tpot_p90_s"], ttft_s=r["ttft_s"], hit_rate=r["decode_hit_rate"],
                         expert_bytes_per_token=r["expert_bytes_per_token"], compute_only_s=compute_only["tpot_s"],
                         io_bound_s=io_bound, ratio_to_bound=r["tpot_s"] / bound, peak_rss_bytes=r["peak_rss_bytes"],
                         expert_cache_bytes=r["expert_cache_bytes"], dense_bytes=r["dense_bytes"],
                         kv_bytes=r["kv_bytes"], rss_overhead_bytes=r["peak_rss_bytes"] - accounted))
    summary = dict(model=model, store=str(store), read_bandwidth_before=bw_before, read_bandwidth_after=bw_after,
                   compute_only=compute_only)
    return summary, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(ap)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS) +
                    ", or any model name or store path")
    ap.add_argument("--reader-threads", type=int, default=4)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from moetier.progress import tqdm

    models = args.models.split(",")
    bar = tqdm(total=len(models) * (len(args.budgets.split(",")) + 1), desc="bench", unit="run")
    summaries, rows = [], []
    for model in models:
        summary, model_rows = bench_model(model, args, bar)
        summaries.append(summary)
        rows += model_rows
    bar.close()
    report = dict(policy=args.policy, tokens=args.tokens, warmup_tokens=args.warmup_tokens,
                  prompt_len=args.prompt_len, models=summaries, rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offload.json").write_text(json.dumps(report, indent=1))
    plot(rows, args.out / "offload.png")

    for m in summaries:
        print(f"{m['model']}: O_DIRECT read {m['read_bandwidth_before'] / 1e9:.2f} GB/s before, "
              f"{m['read_bandwidth_after'] / 1e9:.2f} GB/s after; compute-only TPOT "
              f"{m['compute_only']['tpot_s'] * 1e3:.1f} ms")
    print(f"{'model':>18} {'budget':>7} {'TPOT ms':>8} {'p90 ms':>7} {'hit':>6} {'MiB/tok':>8} {'I/O ms':>7} "
          f"{'ratio':>6} {'RSS MiB':>8} {'overhead MiB':>12}")
    for r in rows:
        print(f"{r['model']:>18} {r['budget']:>7} {r['tpot_s'] * 1e3:8.1f} {r['tpot_p90_s'] * 1e3:7.1f} "
              f"{r['hit_rate']:6.1%} {r['expert_bytes_per_token'] / 2**20:8.1f} {r['io_bound_s'] * 1e3:7.1f} "
              f"{r['ratio_to_bound']:6.2f} {r['peak_rss_bytes'] / 2**20:8.0f} {r['rss_overhead_bytes'] / 2**20:12.0f}")
    print(f"wrote {args.out / 'offload.json'} and {args.out / 'offload.png'}")


if __name__ == "__main__":
    main()
