"""Decode on a GPU whose memory holds a share of the experts: moetier's modes at several GPU expert budgets, beside
Hugging Face transformers with accelerate's offload on the same weights, written as JSON rows as they finish (so a
run cut short keeps what it measured).

Models: `demo-fine-xl` (the trained demo-fine, real routing, every expert inflated to 12 MiB; built on first use),
`olmoe-synth` (OLMoE-1B-7B's shape, random bf16 weights: `moetier synth`, then written out as a Hugging Face
checkpoint for accelerate — the same numbers in both; `small-synth`, a small shape, tries the script out) and
`dsv2-lite-synth` (DeepSeek-V2-Lite's shape, random bf16 weights, a Hugging Face checkpoint first: hf_synth.py).

Tiers: `host` rows load through a host tier holding every expert at the precisions the modes read (page-locked,
filled once per model and handed to each engine); `disk` rows have none (`--host-memory 0`: every miss is read
from disk, through staging buffers). Per configuration (in this process, one after the other; each engine closed
and its GPU memory freed before the next): a warm-up generation (the cache fills), then the measured one; TPOT, decode tok/s, TTFT, hit rate, expert
bytes read per token, prefetch counts, the GPU's peak memory. Modes: `lru` (on-demand, exact), `hobbit` (HOBBIT's
mixed precision), `prefetch-hobbit`/`prefetch-presched` (stacked-gates predictor), `prefetch-oracle` (the true
routing of the lru run: the bound), `substitute` (SMoE, α 0.35), `cpu-assist` (placement: the host CPU computes a
missing expert from host memory where that beats copying it), `cpu-offload` (llama.cpp's `--n-cpu-moe`: the cache
preloaded layer by layer, every other expert computed by the host CPU), `torch-kernels` (`--kernel-budgets`: lru
with the experts through torch's ops rather than Triton's), `cuda-graphs` (`--graph-budgets`: lru with a decode step
of up to 8 sequences replayed as a CUDA graph where every expert is resident, each layer's dense part one below
100%, at each --batch; each row records what the graphs did), `prefetch-hobbit-graphs` (prefetch-hobbit with them).

    python bench/gpu/bench_gpu.py --out DIR [--models demo-fine-xl] [--budgets 10%,25%,50%,100%] [--batch 1,8]
        [--modes hobbit,prefetch-hobbit,...] [--disk-budgets 25%]
    python bench/gpu/bench_gpu.py --out DIR --accelerate olmoe-synth:25%
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench_prefetch import RouteLog  # noqa: E402 (every (step, layer)'s routing: the oracle's truth)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_synth  # noqa: E402
from hf_synth import HF_SYNTHS  # noqa: E402

PROMPTS = ROOT / "prompts" / "mixed.txt"
SYNTHS = {"olmoe-synth": "olmoe-1b-7b", "small-synth": "small"}  # random weights of a preset's shape (synth.py)


def modes() -> dict[str, dict]:
    from moetier.plan.precision import MixedPrecision
    from moetier.plan.substitute import Substitution

    return {
        "lru": {},  # every mode but comoe evicts by LRU (POLICY), as the first GPU runs did, whatever the default
        "comoe": {"policy": "comoe"},  # the default since 2026-11-29 (docs/cache-policies.md)
        "hobbit": {"precision": MixedPrecision("hobbit")},
        "prefetch-hobbit": {"prefetch": "hobbit", "predictor": "stacked-gates"},
        "prefetch-hobbit-fifo": {"prefetch": "hobbit", "predictor": "stacked-gates"},  # (MODE_COPY_ORDERS)
        "prefetch-presched": {"prefetch": "presched", "predictor": "stacked-gates"},
        "prefetch-oracle": {"prefetch": "hobbit", "predictor": "oracle"},  # handed in: the lru run's routing
        "substitute": {"substitution": Substitution(alpha=0.35)},
        "cpu-assist": {"placement": "greedy"},
        "cpu-offload": {"placement": "cpu-offload"},  # llama.cpp's --n-cpu-moe: every miss computed on the host
        "torch-kernels": {"kernels": "torch"},  # the experts through torch's ops, not Triton's (--kernel-budgets)
        "cuda-graphs": {"cuda_graphs": True},  # --graph-budgets: lru with graphs (a resident step one; below 100%
        # each layer's dense part one)
        "prefetch-hobbit-graphs": {"prefetch": "hobbit", "predictor": "stacked-gates", "cuda_graphs": True},
    }


POLICY = "lru"  # what a mode evicts by unless it says

MODE_COPY_ORDERS = {"prefetch-hobbit-fifo": "fifo"}  # modes that queue the host tier's copies otherwise than
# demand-first: every prefetch copy on the stream when asked for, ahead of later on-demand ones
# (engine/copy_queue.py; the first GPU runs' order, for a side-by-side of what holding prefetches back gains)

PRELOADED = {"cpu-offload"}  # modes started with the cache preloaded, as every 100% row: llama.cpp's way, a fixed
# set of experts on the GPU (layer by layer), the rest on the host (cpu-offload never loads)


def label_and_source(entry: str) -> tuple[str, str]:
    """A --models entry: NAME (a built-in, a synthetic shape, a path) or LABEL=NAME (the rows' model named LABEL: a
    GGUF file's rows beside llama.cpp's on the same file, `olmoe-synth Q4_K_M=PATH.gguf`)."""
    label, _, source = entry.rpartition("=")
    return (label or source), source


def store_of(model: str, cache: Path) -> Path:
    """The store for a model name: a built-in (made on first use), the synthetic OLMoE (made here) or a shape of
    another family with random weights (hf_synth.py)."""
    from moetier.resolve import resolve_model

    if model in HF_SYNTHS:
        return hf_synth.store(model, cache)[0]
    if model in SYNTHS:
        path = cache / "bench-gpu" / model
        if not (path / "manifest.json").exists():
            from moetier.store.synth import PRESETS, synthesize
            synthesize(PRESETS[SYNTHS[model]], path, progress=False)
        return path
    return resolve_model(model, progress=False)


def prompt_ids(engine, model: str, batch: int, length: int) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-up, measured) prompts, `batch` of each: random ids for random weights, real text otherwise."""
    if model in SYNTHS or model in HF_SYNTHS:
        rng = random.Random(0)
        draw = lambda: [rng.randrange(engine.spec.vocab_size) for _ in range(length)]  # noqa: E731
        return [draw() for _ in range(batch)], [draw() for _ in range(batch)]
    lines = [line for line in PROMPTS.read_text().splitlines() if line.strip()]
    ids = [engine.tokenizer.encode(line)[:length] for line in lines]
    return [ids[i % len(ids)] for i in range(batch)], [ids[(i + batch) % len(ids)] for i in range(batch)]


def gpu_peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def gpu_peak(device: str) -> int | None:
    return torch.cuda.max_memory_allocated() if device.startswith("cuda") else None


def freed(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def precisions_for(store: Path, mode_names: list[str]) -> list[str]:
    """The precisions the modes read (HOBBIT's low copies beside the model's own), added to the store where it
    lacks them (the engine refuses a mode whose copies are missing)."""
    from moetier.store.store import Store
    from moetier.store.variants import add_precisions

    s = Store(store)
    native = s.manifest.native_precision
    precisions = list(dict.fromkeys(p for m in mode_names
                                    for p in modes()[m].get("precision", _native()).host_precisions(native)))
    missing = [p for p in precisions if p not in s.manifest.precisions]
    if missing:
        add_precisions(s.path, ",".join(missing), progress=False)
    return precisions


def host_tier_for(store: Path, precisions: list[str]):
    """One host tier holding every expert at each of `precisions`, filled once and handed to each engine of the
    model (a tier of its own per engine would read the whole model from disk again for each)."""
    from moetier.config import HostMemory
    from moetier.engine.budget import plan_host_tier
    from moetier.engine.host_tier import HostTier
    from moetier.memory import memory_available
    from moetier.store.reader import ExpertReader
    from moetier.store.store import Store

    s = Store(store)
    choice = plan_host_tier(s, HostMemory(), memory_available(), tuple(precisions))
    tier = HostTier(s.manifest, s.spec.expert_keys(), choice.slots)
    start = time.perf_counter()
    with ExpertReader(s.path, 8, manifest=s.manifest) as reader:
        tier.fill(reader, progress=False)
    return tier, time.perf_counter() - start, choice.note


def _native():
    from moetier.plan.precision import MixedPrecision
    return MixedPrecision()


def run_moetier(model: str, store: Path, budget: str, mode: str, batch: int, tokens: int, warmup: int,
                prompt_len: int, truth: dict | None, device: str, tier=None) -> tuple[dict, dict | None]:
    """One configuration; `tier`: the host tier to load through (None: no host tier, every miss read from disk)."""
    from moetier.config import HostMemory, MemoryBudget
    from moetier.engine.engine import Engine, EngineConfig
    from moetier.predict.oracle import OraclePredictor
    from moetier.store.store import Store

    s = Store(store)
    oracle = None
    if mode == "prefetch-oracle":
        spec = s.spec
        oracle = OraclePredictor(spec.moe_layers, spec.num_experts, spec.top_k,
                                 lambda step, layer: truth[(step, layer)], 2)
    gpu_peak_reset(device)
    start = time.perf_counter()
    config = modes()[mode]
    if device.startswith("cuda") and tier is None:
        config = {**config, "host_memory": HostMemory(None)}
    config = {"policy": POLICY, **config}
    engine = Engine(s, EngineConfig(expert_memory=MemoryBudget.parse(budget), device=device, **config),
                    predictor=oracle, progress=False, host_tier=tier,
                    copy_order=MODE_COPY_ORDERS.get(mode, "demand-first"))
    setup_s = time.perf_counter() - start
    log = RouteLog()
    if mode == "lru":
        engine.executor.layer_step.hooks.append(log)
    with engine:
        if budget == "100%" or mode in PRELOADED:  # everything fits: start with the whole model resident
            engine.preload()
        warm, measured = prompt_ids(engine, model, batch, prompt_len)
        engine.generate(warm, max_new_tokens=warmup, ignore_eos=True)
        copies = engine.executor.copies  # (a GPU's copy queue behind a host tier)
        before = copies and dataclasses.asdict(copies.counts)
        stats = engine.generate(measured, max_new_tokens=tokens, ignore_eos=True).stats
        graphs = getattr(engine.model, "graphs", None)  # (both calls': the measured one replays the warm-up's, the
        # engine keeping its KV cache)
        graphs = None if graphs is None else dict(graphs.status)
        costs = running_costs(engine.executor.costs)
    row = {k: stats[k] for k in ("ttft_s", "tpot_s", "tpot_p50_s", "tpot_p90_s", "decode_tokens_per_s",
                                 "decode_hit_rate", "expert_bytes_per_token", "expert_cache_bytes", "expert_slots",
                                 "prefetches")}
    mixed = engine.executor.mixed  # (the precision mode as the engine resolved it: what sim_check.py replays)
    row.update(precision=dataclasses.asdict(mixed) if mixed.mixed else None, copies=copy_counts(copies, before, mode),
               policy=engine.config.policy, graphs=graphs, costs=costs)
    row.update(setup_s=setup_s, gpu_peak_bytes=gpu_peak(device), host_tier=stats.get("host_tier"),
               host_runs=stats["decode"].get("host_runs"), substituted=stats["decode"].get("substituted"))
    del engine
    freed(device)
    return row, (log.routes if mode == "lru" else None)


def running_costs(costs) -> dict:
    """What the stages that weigh time heard last (plan/costs.py RunningCosts, smoothed): a layer's dense part from
    the host's end of the one before to its routing back, an expert's compute and a copy's link time, as this
    machine's clocks read them — what the simulator's stages are to hear in its place (sim/executor.py)."""
    return {"dense_s": costs.dense_s, "expert_s": costs.expert_s, "read_s": costs.read_s,
            "host_s_1": costs.host_s(1) if costs.placement_ready else None}


def copy_counts(copies, before: dict | None, mode: str) -> dict | None:
    """What a GPU's copy queue did with the measured call's prefetch copies (engine/copy_queue.py), and its order."""
    if copies is None:
        return None
    now = dataclasses.asdict(copies.counts)
    return {"order": MODE_COPY_ORDERS.get(mode, "demand-first"), **{k: v - before[k] for k, v in now.items()}}


def run_accelerate(hf: Path, gpu_bytes: int, batch: int, tokens: int, prompt_len: int, vocab: int,
                   device: str) -> dict:
    """What a Hugging Face user runs: transformers with accelerate placing layers on the GPU up to `gpu_bytes` and
    the rest in host memory (moved to the GPU for every forward by accelerate's hooks)."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16, device_map="auto",
                                                 max_memory={0: gpu_bytes, "cpu": 120 << 30}
                                                 if device.startswith("cuda") else None)
    setup_s = time.perf_counter() - start
    placed = {}
    for where in getattr(model, "hf_device_map", {"": "cpu"}).values():
        placed[str(where)] = placed.get(str(where), 0) + 1
    rng = random.Random(1)
    ids = torch.tensor([[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)], device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(n: int) -> float:
        sync()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - t

    timed(2)  # warm-up
    ttft = timed(1)
    total = timed(tokens)
    tpot = (total - ttft) / (tokens - 1)
    return {"ttft_s": ttft, "tpot_s": tpot, "decode_tokens_per_s": batch / tpot, "setup_s": setup_s,
            "device_map": placed, "gpu_budget_bytes": gpu_bytes}


def export_hf_checkpoint(store: Path, out: Path) -> Path:
    sys.path.insert(0, str(ROOT / "peers"))
    from export import export_hf
    return export_hf(store, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for rows.json")
    ap.add_argument("--models", default="demo-fine-xl", help="comma-separated: a built-in model, a synthetic shape "
                    "(olmoe-synth, dsv2-lite-synth), a path (a GGUF file), each as LABEL=... to name its rows")
    ap.add_argument("--budgets", default="10%,25%,50%,100%")
    ap.add_argument("--batch", default="1,8", help="the first for every row; the others at --batch-budgets")
    ap.add_argument("--batch-budgets", default="25%,100%", help="the lru budgets the larger batches run at")
    ap.add_argument("--modes", default="lru", help=f"comma-separated, run at --mode-budget: {', '.join(modes())}")
    ap.add_argument("--mode-budget", default="25%", help="the budget the modes other than lru run at")
    ap.add_argument("--disk-budgets", default="25%", help="lru budgets run again with no host tier (every miss read "
                                                         "from disk)")
    ap.add_argument("--kernel-budgets", default="", help="lru budgets run again with --kernels torch (the experts "
                                                         "through torch's ops, against Triton's in the lru rows)")
    ap.add_argument("--graph-budgets", default="", help="lru budgets run again with --cuda-graphs at each --batch "
                                                        "(a resident step replayed as a CUDA graph; below 100%%, each layer's "
                                                        "dense part)")
    ap.add_argument("--rounds", type=int, default=1, help="every configuration this many times, rotated")
    ap.add_argument("--process-warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="run the first configuration once, unrecorded, before the measured ones")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--accelerate", default="", help="MODEL:BUDGET,...: accelerate's offload at that GPU budget "
                                                     "(the dense weights plus that share of the experts)")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark), or cpu (to try this script out)")
    ap.add_argument("--cache", type=Path, default=None, help="where stores are made (default: moetier's cache)")
    args = ap.parse_args()
    from moetier.paths import default_cache_dir

    cache = args.cache or default_cache_dir()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"

    def record(row: dict) -> None:
        rows.append(row)
        (args.out / "rows.json").write_text(json.dumps({"device": device_name, "rows": rows},
                                                       indent=1))
        keys = ("model", "engine", "mode", "tier", "budget", "batch", "tpot_s", "decode_tokens_per_s",
                "decode_hit_rate", "fill_s", "error")
        print(" ".join(f"{k}={row[k]:.4g}" if isinstance(row.get(k), float) else f"{k}={row.get(k)}"
                       for k in keys if k in row), flush=True)

    # accelerate's rows first: the benchmark's reason to be (issue 52: >= 3x its offload), where a deadline cutting
    # the call short takes the last rows
    for item in [a for a in args.accelerate.split(",") if a]:
        model, _, budget = item.partition(":")
        base = {"model": model, "engine": "accelerate", "mode": "offload", "budget": budget, "batch": 1}
        try:
            from moetier.config import MemoryBudget
            from moetier.store.store import Store

            store = store_of(model, cache)
            s = Store(store)
            share = MemoryBudget.parse(budget)
            gpu_bytes = int(s.dense_bytes + share.value * s.total_expert_bytes())
            hf = hf_synth.store(model, cache)[1] if model in HF_SYNTHS else export_hf_checkpoint(
                store, cache / "bench-gpu" / f"{model}-hf")
            record({**base, **run_accelerate(hf, gpu_bytes, 1, 8, 32, s.spec.vocab_size, args.device)})
            freed(args.device)  # (the model went with the call)
        except (Exception, SystemExit) as e:  # (an export refusing a family exits: a row of its own, the rows go on)
            record({**base, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]})

    for entry in [m for m in args.models.split(",") if m]:
        model, source = label_and_source(entry)
        try:
            store = store_of(source, cache)
        except Exception as e:
            record({"model": model, "error": f"{type(e).__name__}: {e}"})
            continue
        truth: dict[int, dict] = {}
        batches = list(map(int, args.batch.split(",")))
        mode_names = [m for m in args.modes.split(",") if m and m != "lru"]
        plan = [(b, "lru", batches[0], "host") for b in args.budgets.split(",")]
        plan += [(args.mode_budget, m, batches[0], "host") for m in mode_names]
        plan += [(b, "lru", batches[0], "disk") for b in args.disk_budgets.split(",") if b]
        plan += [(b, "torch-kernels", batches[0], "host") for b in args.kernel_budgets.split(",") if b]
        plan += [(b, "cuda-graphs", n, "host") for n in batches for b in args.graph_budgets.split(",") if b]
        plan += [(b, "lru", n, "host") for n in batches[1:] for b in args.batch_budgets.split(",")]
        tier, precisions = None, precisions_for(store, ["lru", *mode_names])
        if args.device.startswith("cuda"):
            try:
                tier, fill_s, note = host_tier_for(store, precisions)
                record({"model": model, "engine": "moetier", "mode": "host-tier-fill", "fill_s": fill_s,
                        "note": note, "host_bytes": tier.nbytes})
            except Exception as e:
                record({"model": model, "mode": "host-tier-fill", "error": f"{type(e).__name__}: {e}",
                        "traceback": traceback.format_exc()[-2000:]})
        if plan and args.process_warmup:  # the process's first engine pays what later ones reuse (cuDNN's and
            # cuBLAS's plans for each shape, the allocator's growth): 141 ms a token against ~10 in the first run
            budget, mode, batch, where = plan[0]
            try:
                run_moetier(model, store, budget, mode, batch, args.tokens, args.warmup, args.prompt_len, None,
                            args.device, tier if where == "host" else None)
            except Exception:
                pass
            freed(args.device)
        for r in range(args.rounds):  # each round in a rotated order, so a drift touches every configuration
            for budget, mode, batch, where in plan[r % len(plan):] + plan[:r % len(plan)]:
                base = {"model": model, "engine": "moetier", "mode": mode, "budget": budget, "batch": batch,
                        "tier": where if args.device.startswith("cuda") else "cpu", "round": r}
                if (where == "host" and args.device.startswith("cuda") and tier is None) or (
                        mode == "prefetch-oracle" and batch not in truth):
                    continue
                try:
                    row, routes = run_moetier(model, store, budget, mode, batch, args.tokens, args.warmup,
                                              args.prompt_len, truth.get(batch), args.device,
                                              tier if where == "host" else None)
                    if routes is not None and budget == args.mode_budget and batch not in truth:
                        truth[batch] = routes
                    record({**base, **row})
                except Exception as e:
                    record({**base, "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-2000:]})
                    freed(args.device)
        if tier is not None:
            tier.close()
            del tier
            freed(args.device)


if __name__ == "__main__":
    main()
