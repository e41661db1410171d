"""Decode against the memory roofline, and under expert budgets against max(compute bound, I/O bound).

Resident (every expert in memory), per model and per kernel set (`torch`: torch's ops; `native`: moetier's
one-row bf16 kernels): the bytes one decode step must read — the dense weights it multiplies (attention,
routers, norms, the head; one embedding row), the experts the token routes to, the KV cache at the mean
context — over the memory bandwidth measured in the same process right before and after (a streaming fp32 sum
over a buffer of that size, two threads): the roofline. Ratio = TPOT / roofline.

Under budgets (native kernels, LRU): the first tokens from a cold cache (warm-up) and the steady state after
them, each TPOT against max(compute bound = the resident native TPOT, I/O bound = the expert bytes read per
token at the disk's bandwidth). The disk here (a shared virtio volume) reads anywhere from 1.2 to 3.5 GB/s from
one minute to the next, so a bandwidth measured beside the run does not bound it; the I/O bound is taken from the
run itself: the reader's busy time per decode step (time with at least one read running), i.e. the bytes at the
bandwidth the disk gave while it was reading. Ratio 1.0 means the disk never sat idle during decoding; what the
ratio exceeds 1 by is time the disk idled while the compute ran. The O_DIRECT bandwidth measured before and after
the model's runs (the engine's reader on whole blobs) is reported beside it.

    python bench/bench_roofline.py                          # olmoe-1b-7b-synth and demo-deep-xl
    python bench/bench_roofline.py --models demo-deep-xl --budgets 50%
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from bench_offload import SYNTH, prompts, store_of  # noqa: E402
from common import OUT, model_panels, run_child, save_panels  # noqa: E402

MODELS = (SYNTH, "demo-deep-xl")
KERNEL_SETS = ("torch", "native")


def stream_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of the fastest of `repeats` streaming reads (an fp32 sum) over a fresh buffer of `nbytes`."""
    import torch

    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(repeats))
    return buf.numel() * 4 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_bytes(engine, context: float) -> dict:
    """What one batch-1 decode step reads, by part."""
    import torch

    spec, w = engine.spec, engine.model.w
    size = {name: t.numel() * t.element_size() for name, t in w.items()}
    dense = sum(size.values())
    if "lm_head" in w:  # untied: the embedding table is looked up, one row read, not streamed
        dense -= size["embed_tokens"] - size["embed_tokens"] // spec.vocab_size
    experts = len(spec.moe_layers) * spec.top_k * engine.store.native_layout.blob_bytes
    kv = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * context * torch.finfo(engine.model.dtype).bits // 8
    return dict(dense=dense, experts=experts, kv=int(kv), total=int(dense + experts + kv))


def decode(engine, prompt: list[int], tokens: int) -> dict:
    """Generate; the statistics plus the disk's busy time and bytes over the decode steps alone."""
    from moetier.plan.route import DECODE

    marks = []

    def first_decode(batch, phase) -> None:
        if phase == DECODE and not marks:
            marks.append(engine.reader.activity())

    engine.step_hooks.append(first_decode)
    stats = engine.generate([prompt], max_new_tokens=tokens, ignore_eos=True).stats
    engine.step_hooks.remove(first_decode)
    busy, nbytes = engine.reader.activity()
    steps = max(1, stats["new_tokens"] - 1)  # batch 1: every token after the first is one decode step
    return dict(stats, disk_busy_per_step_s=(busy - marks[0][0]) / steps,
                disk_bytes_per_step=(nbytes - marks[0][1]) / steps)


def child(cfg: dict) -> dict:
    """One configuration, in its own process (its own memory, and the kernels it was asked for)."""
    import torch

    from moetier import Engine

    engine = Engine.from_pretrained(cfg["store"], expert_memory=cfg["budget"], progress=False,
                                    kernels=cfg["kernels"])
    warm_prompt, prompt = prompts(engine, cfg)
    with engine:
        if cfg["budget"] == "100%":
            engine.preload()
        warm = decode(engine, warm_prompt, cfg["warmup_tokens"])
        if cfg["budget"] != "100%":
            return dict(warmup=warm, steady=decode(engine, prompt, cfg["tokens"]), kernels=engine.kernels.name)
        nbytes = step_bytes(engine, len(prompt) + cfg["tokens"] / 2)
        bw_before = stream_bandwidth(nbytes["total"])
        stats = engine.generate([prompt], max_new_tokens=cfg["tokens"], ignore_eos=True).stats
        bw_after = stream_bandwidth(nbytes["total"])
        return dict(steady=stats, kernels=engine.kernels.name, step_bytes=nbytes, threads=torch.get_num_threads(),
                    memory_bandwidth=statistics.mean((bw_before, bw_after)),
                    memory_bandwidth_before=bw_before, memory_bandwidth_after=bw_after)


def bench_model(model: str, args, bar) -> list[dict]:
    from moetier.calibrate import disk_tier
    from moetier.store.store import Store

    store = store_of(model)
    base = dict(store=str(store), tokens=args.tokens, warmup_tokens=args.warmup_tokens, prompt_len=args.prompt_len,
                seed=0, random_prompts=model == SYNTH)
    rows, resident = [], {}
    for kernels in KERNEL_SETS:
        r = run_child(__file__, dict(base, budget="100%", kernels=kernels))
        bar.update()
        roofline = r["step_bytes"]["total"] / r["memory_bandwidth"]
        resident[kernels] = r["steady"]["tpot_s"]
        rows.append(dict(model=model, kind="resident", kernels=r["kernels"], budget="100%", phase="steady",
                         tpot_s=r["steady"]["tpot_s"], bound_s=roofline, bound="memory roofline",
                         ratio=r["steady"]["tpot_s"] / roofline, step_bytes=r["step_bytes"],
                         memory_bandwidth=r["memory_bandwidth"], threads=r["threads"]))
    disk_before = disk_tier(Store(store)).bandwidth_bytes_per_s
    budget_runs = []
    for budget in args.budgets.split(","):
        budget_runs.append((budget, run_child(__file__, dict(base, budget=budget, kernels="native"))))
        bar.update()
    disk = statistics.mean((disk_before, disk_tier(Store(store)).bandwidth_bytes_per_s))
    compute = resident["native"]
    for budget, r in budget_runs:
        for phase in ("warmup", "steady"):
            s = r[phase]
            io = s["disk_busy_per_step_s"]
            rows.append(dict(model=model, kind="budget", kernels=r["kernels"], budget=budget, phase=phase,
                             tpot_s=s["tpot_s"], bound_s=max(compute, io), compute_bound_s=compute, io_bound_s=io,
                             bound="max(compute, I/O)", ratio=s["tpot_s"] / max(compute, io),
                             hit_rate=s["decode_hit_rate"], expert_bytes_per_token=s["expert_bytes_per_token"],
                             disk_bandwidth_while_busy=s["disk_bytes_per_step"] / max(io, 1e-9),
                             disk_bandwidth_measured=disk))
    return rows


def plot(rows: list[dict], path: Path) -> None:
    fig, panels = model_panels(rows, 5.5, 4.2)
    for ax, model, mine in panels:
        labels = [f"{r['budget']} {r['kernels'] if r['kind'] == 'resident' else r['phase']}" for r in mine]
        x = range(len(mine))
        ax.bar([i - 0.2 for i in x], [r["tpot_s"] * 1e3 for r in mine], 0.4, label="TPOT (measured)")
        ax.bar([i + 0.2 for i in x], [r["bound_s"] * 1e3 for r in mine], 0.4,
               label="bound: memory roofline (100%), max(compute, I/O) (budgets)")
        for i, r in zip(x, mine):
            ax.text(i - 0.2, r["tpot_s"] * 1e3, f"{r['ratio']:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(x), labels, rotation=45, ha="right", fontsize=8)
        ax.set_title(model)
    save_panels(fig, "moetier decode against its bounds (ratio above each bar)", path, legend_fontsize=7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--budgets", default="75%,50%,25%")
    ap.add_argument("--tokens", type=int, default=32, help="measured tokens")
    ap.add_argument("--warmup-tokens", type=int, default=16, help="tokens from a cold cache, reported apart")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from moetier.progress import tqdm

    models = args.models.split(",")
    bar = tqdm(total=len(models) * (len(KERNEL_SETS) + len(args.budgets.split(","))), desc="bench", unit="run")
    rows = [row for model in models for row in bench_model(model, args, bar)]
    bar.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "roofline.json").write_text(json.dumps(dict(tokens=args.tokens, warmup_tokens=args.warmup_tokens,
                                                            rows=rows), indent=1))
    plot(rows, args.out / "roofline.png")
    for r in rows:
        if r["kind"] == "resident":
            b = r["step_bytes"]
            print(f"{r['model']}: {r['kernels']} kernels, {r['threads']} threads; a step reads "
                  f"{b['total'] / 1e6:.0f} MB (dense {b['dense'] / 1e6:.0f}, experts {b['experts'] / 1e6:.0f}, "
                  f"KV {b['kv'] / 1e6:.1f}) at {r['memory_bandwidth'] / 1e9:.1f} GB/s")
    print(f"{'model':>18} {'budget':>6} {'kernels':>7} {'phase':>7} {'TPOT ms':>8} {'bound ms':>9} {'ratio':>6} "
          f"{'hit':>6} {'disk busy ms':>12} {'GB/s busy':>9}")
    for r in rows:
        extra = (f"{r['hit_rate']:6.1%} {r['io_bound_s'] * 1e3:12.1f} {r['disk_bandwidth_while_busy'] / 1e9:9.2f}"
                 if r["kind"] == "budget" else "")
        print(f"{r['model']:>18} {r['budget']:>6} {r['kernels']:>7} {r['phase']:>7} {r['tpot_s'] * 1e3:8.1f} "
              f"{r['bound_s'] * 1e3:9.1f} {r['ratio']:6.2f} {extra}")
    print(f"wrote {args.out / 'roofline.json'} and {args.out / 'roofline.png'}")


if __name__ == "__main__":
    main()
