"""The host's time a MoE layer on the GPU path, measured on any CPU: what bounds the H200's decode step below 100%
(docs/gpu.md, the 2026-11-30 run: the copies take 21.6 ms a token, the step 44.2).

The engine runs with a host tier holding every expert, as bench_gpu.py's `host` rows do, but CUDA's calls are stood
in for (events and streams no-ops: a copy is done when queued), so what is timed is the engine's own Python —
planning, the copy queue's bookkeeping, grouping, the launches' dispatch — on an OLMoE-shaped model (16 layers, 64
experts, top-8) at tiny widths, whose kernels cost little. The host waits for each layer's routing where a GPU's
would (the executor's `wait`: its copy queue's, then the pools told the device's work is done), though here there
is nothing to wait for. Modes are bench_gpu.py's (evicting by LRU unless they say), alternated within each round;
the measure is a decode step's wall time over its MoE layers, the median of the rounds (beside it the same on the
thread's CPU clock, which leaves out time the thread did not run). It leaves out what a GPU adds: the CUDA calls'
own host time (cudaMemcpyAsync, event records; ~20 µs a copy on the H200 under the profiler) and the launches'
(10–24 µs each there). It counts the calls, though — the events, stream waits and stream switches the engine makes
through the stand-ins, a MoE layer (`cuda_calls_per_layer`; not the dense part's launches, which
tests/engine/test_launch_count.py counts): what a mode adds there, by count. The device's experts are computed by the CPU's kernels (their Python and their compute, which a GPU's host does not
do), or with `--kernels triton` as a GPU with triton computes them (TritonExperts: a layer's experts of a precision
in one call, its table of addresses built and copied, two launches) with the launches stood in for and counted by
name with the CUDA calls ("triton launch", "table copy"; gpu_profile.py prices a launch at micro.py's Triton one).

    python bench/gpu/host_time.py --out bench/out/host-time.json [--modes lru,prefetch-hobbit] [--rounds 3] \
        [--kernels triton]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPE = dict(hidden_size=64, intermediate_size=32, num_heads=4, num_kv_heads=4, vocab_size=256)  # OLMoE's layers
DEFAULT_MODES = "lru,hobbit,prefetch-hobbit,prefetch-presched,substitute,comoe"


class CudaCalls:
    """The CUDA runtime calls the engine made through the stand-ins, by name: what a GPU would charge the host for
    on top of the time measured here (~5–20 µs each on the H200; the kernels' launches are not among them)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __call__(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def total(self) -> int:
        return sum(self.counts.values())


class _Event:
    calls: CudaCalls

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream=None) -> None:
        self.calls("event.record")

    def synchronize(self) -> None:
        self.calls("event.synchronize")

    def query(self) -> bool:
        self.calls("event.query")
        return True

    def elapsed_time(self, end) -> float:
        self.calls("event.elapsed_time")
        return 0.23  # (ms: a 12 MiB expert's copy on the H200, so the planner prices loads as a GPU's)


class _Stream:
    calls: CudaCalls

    def __init__(self, device=None) -> None:
        pass

    def wait_event(self, event) -> None:
        self.calls("stream.wait_event")

    def synchronize(self) -> None:
        self.calls("stream.synchronize")


class _Pinning:
    def pin(self, ptr: int, nbytes: int) -> None:
        pass

    def unpin(self, ptr: int) -> None:
        pass


def stand_in_cuda() -> CudaCalls:
    """CUDA's events and streams as no-ops, for the rest of the process (a copy is done when queued); returns the
    count of the calls made through them."""
    calls = CudaCalls()
    event = type("_Event", (_Event,), {"calls": calls})  # (classes of their own: the count is this call's)
    stream = type("_Stream", (_Stream,), {"calls": calls})

    def switch(s):
        calls("stream switch")  # (torch.cuda.stream: the current stream set, and set back after)
        return contextlib.nullcontext()

    torch.cuda.Event, torch.cuda.Stream = event, stream
    torch.cuda.current_stream = lambda device=None: stream()
    torch.cuda.stream = switch
    return calls


def stand_in_routing_wait() -> None:
    """The host's wait for each layer's routing as on a GPU, for the rest of the process: the executor's `wait` (its
    copy queue's `wait_current`, then the pools told the device's work so far is done) called where a GPU's copy back
    would call it — on the CPU the routing is the tensors' own memory and nothing was waited for, so the copy queue's
    calls there went uncounted, and every copy into a slot read a layer before waited on the device for a mark the
    GPU's host knows is done (SlotReads.device_done)."""
    from moetier.engine import expert_executor

    name = "route_arrays_with" if hasattr(expert_executor, "route_arrays_with") else "route_arrays"  # (an engine of
    # before 2026-11-30's predictor read back with the routing: worktrees of the runs' own commits)
    read = getattr(expert_executor, name)

    def waited(*args, wait=None):
        if len(args) == (5 if name == "route_arrays_with" else 4):  # (`wait` passed by position)
            *args, wait = args
        if wait is not None:
            wait()
        return read(*args)

    setattr(expert_executor, name, waited)


class _TritonKernel:
    """One of a layer's two Triton kernels (moetier/model/triton_kernels.py) stood in for: `kernel[grid](*args)`
    counts a launch ("triton launch": on the H200 one cost the host ~35-49 us, micro.py's `gpu_rope_T1_host_s` and
    `gpu_rms_norm_T1_host_s` on 2026-11-30, several torch launches' worth) and computes nothing; the one that writes
    the experts' outputs (`out`: its argument's place) writes zeros, so a layer's experts add nothing to the residual
    and the routing stays finite."""

    def __init__(self, calls: CudaCalls, out: int | None = None) -> None:
        self.calls, self.out = calls, out

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs) -> None:
        self.calls("triton launch")
        if self.out is not None:
            args[self.out].zero_()


def on_triton(engine, calls: CudaCalls) -> None:
    """The engine's device pools computed as on a GPU with triton (moetier/model/triton_experts.py TritonExperts: a
    layer's experts of a precision in one call — its table of addresses built, copied to the device, two launches),
    the kernels stood in for (`_TritonKernel`): what the host does for a GPU's expert compute, in place of the CPU's
    kernels, whose compute and Python a GPU's host does not do. The table's copy to the device counts one call
    ("table copy"); on the CPU the table is used where it is. The host lane's experts (cpu-assist, cpu-offload) stay
    on the CPU's kernels, as on a GPU."""
    from moetier.model.triton_experts import Tiles, TritonExperts
    from moetier.quant.codes import BITS

    class StoodIn(TritonExperts):
        def _launch(self, ys, xs, weights, ws, spans) -> None:
            calls("table copy")  # (a GPU's: through page-locked memory to the device, one copy)
            super()._launch(ys, xs, weights, ws, spans)

    executor = engine.executor
    kernels = (_TritonKernel(calls), _TritonKernel(calls, out=5))  # (gate_up; down, its ys the 6th argument)
    for precision in executor.pools:
        kernel = StoodIn(BITS.get(precision, 16), executor.expert_kernels[precision], Tiles(16, 32))  # (tiles
        # that fit the harness's widths, 64 and 32)
        kernel._made = kernels
        executor.expert_kernels[precision] = kernel
    if executor._hit is not None:  # (a layer with every expert resident: its kernel taken when it was made)
        executor._hit.kernel = executor.expert_kernels[executor.precision]
    if getattr(engine.model, "resident_step", None) is not None:  # (the CPU's whole decode step in one native call,
        engine.model.resident_step = None  # csrc/decode_step.c: a GPU has none, its resident layers go one by one)


def make_store(folder: Path, layers: int = 16, experts: int = 64) -> Path:
    """The OLMoE-shaped store at tiny widths, with int4 copies (HOBBIT's low ones); made once."""
    from moetier.store.synth import synthesize
    from moetier.store.synth_spec import SynthSpec
    from moetier.store.variants import add_precisions

    path = folder / f"olmoe-narrow-{layers}x{experts}"
    if not (path / "manifest.json").exists():
        synthesize(SynthSpec(**SHAPE, num_layers=layers, num_experts=experts), path, overwrite=True, progress=False)
        add_precisions(path, "int4", progress=False)
    return path


def measure(store, mode: str, config: dict, budget: str, tokens: int, warmup: int, prompt: list[int],
            calls: CudaCalls | None = None, preload: bool = False, triton: bool = False) -> dict:
    """One configuration's decode: the host's time a MoE layer (ms) and a token's, and (given the stand-ins' count)
    the CUDA calls a MoE layer of the measured call made, prefill and decode steps alike."""
    from moetier import Engine
    from moetier.config import MemoryBudget
    from moetier.engine.engine import EngineConfig
    from moetier.engine.host_tier import HostTier
    from moetier.store.reader import ExpertReader

    keys = store.spec.expert_keys()
    precisions = {p: len(keys) for p in store.manifest.precisions}
    tier = HostTier(store.manifest, keys, precisions, _Pinning())
    with ExpertReader(store.path, 2, manifest=store.manifest) as reader:
        tier.fill(reader, progress=False)
    engine_config = EngineConfig(expert_memory=MemoryBudget.parse(budget), **config)
    with Engine(store, engine_config, progress=False, host_tier=tier) as engine:
        if triton:
            on_triton(engine, calls)
        if preload:  # (as bench_gpu.py starts a 100% row and llama.cpp's fixed split)
            engine.preload()
        engine.generate([prompt], max_new_tokens=warmup, ignore_eos=True)
        start = time.thread_time()
        engine.generate([prompt], max_new_tokens=1, ignore_eos=True)  # (its prefill alone: taken off the next)
        prefill_cpu_s = time.thread_time() - start
        before = dict(calls.counts) if calls is not None else {}
        start = time.thread_time()
        out = engine.generate([prompt], max_new_tokens=tokens + 1, ignore_eos=True)
        decode_cpu_s = time.thread_time() - start - prefill_cpu_s
        made = {k: n - before.get(k, 0) for k, n in calls.counts.items()} if calls is not None else None
    decode = out.stats["decode"]
    step_s = out.stats["tpot_s"]  # (the mean decode step: the prefill left out)
    layers = len(store.spec.moe_layers)
    row = {"mode": mode, "budget": budget, "tpot_ms": step_s * 1e3, "host_ms_per_layer": step_s * 1e3 / layers,
           # the same on the thread's CPU clock: without the time it did not run (another process's, a VM's
           # stolen time, where the kernel leaves it out)
           "host_cpu_ms_per_layer": decode_cpu_s * 1e3 / tokens / layers,
           "loads": decode["loads"], "prefetches": decode["prefetches"], "host_runs": decode["host_runs"]}
    if made is not None:  # (the call's steps: its prefill and `tokens` decode steps)
        per_layer = (tokens + 1) * layers
        row["cuda_calls_per_layer"] = sum(made.values()) / per_layer
        row["cuda_calls_by_name_per_layer"] = {k: n / per_layer for k, n in sorted(made.items()) if n}
    return row


def cpu_name() -> str:
    """The CPU's model name (lscpu's), where the system says it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON written")
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"bench_gpu.py's modes (default {DEFAULT_MODES})")
    ap.add_argument("--budget", default="25%", help="the GPU expert budget (default 25%%; 100%% rows are added)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=None, help="where the store is made (default moetier's cache)")
    ap.add_argument("--layers", type=int, default=16, help="MoE layers (default 16: OLMoE's)")
    ap.add_argument("--experts", type=int, default=64, help="experts a layer, top-8 (default 64: OLMoE's)")
    ap.add_argument("--kernels", choices=("cpu", "triton"), default="cpu",
                    help="the device's expert compute: the CPU's kernels (default; what the forecasts so far were "
                    "made with), or a GPU's Triton path with its launches stood in for and counted")
    args = ap.parse_args(argv)
    import bench_gpu

    from moetier.paths import default_cache_dir
    from moetier.store.store import Store

    table = bench_gpu.modes()
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in names if m not in table]
    gpu_only = [m for m in names if m in table and ("graphs" in m or m == "prefetch-oracle")]
    problem = (f"unknown mode {', '.join(unknown)} (one of {', '.join(table)})" if unknown else
               f"not measured here: {', '.join(gpu_only)} (CUDA graphs need a GPU; the oracle, a GPU run's routing)"
               if gpu_only else "counts must be positive, and at least 8 experts (top-8)"
               if min(args.tokens, args.warmup, args.rounds, args.layers) < 1 or args.experts < 8 else None)
    if problem:
        print(f"host_time: error: {problem}", file=sys.stderr)
        return 1
    calls = stand_in_cuda()
    stand_in_routing_wait()
    torch.set_num_threads(1)  # (the kernels are tiny; the host's one thread is what is timed)
    store = Store(make_store(args.cache or default_cache_dir() / "bench", args.layers, args.experts))
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 250, (8,), generator=g).tolist()
    configs = [(m, args.budget, {"policy": bench_gpu.POLICY, **table[m]}) for m in names]
    configs.append(("lru", "100%", {"policy": bench_gpu.POLICY}))
    rows = []
    for r in range(args.rounds):
        shift = r % len(configs)
        for mode, budget, config in configs[shift:] + configs[:shift]:  # (rotated: no mode always first)
            row = measure(store, mode, config, budget, args.tokens, args.warmup, prompt, calls,
                          preload=budget == "100%" or mode in bench_gpu.PRELOADED, triton=args.kernels == "triton")
            rows.append({**row, "round": r})
            print(f"round {r}  {mode:18s} {budget:>4s}  {row['host_ms_per_layer']:.3f} ms a layer "
                  f"({row['host_cpu_ms_per_layer']:.3f} on the thread's CPU clock), "
                  f"{row['cuda_calls_per_layer']:.1f} CUDA calls", flush=True)
    summary = []
    for mode, budget, _ in configs:
        got = [x["host_ms_per_layer"] for x in rows if x["mode"] == mode and x["budget"] == budget]
        cuda = [x["cuda_calls_per_layer"] for x in rows if x["mode"] == mode and x["budget"] == budget]
        cpu = [x["host_cpu_ms_per_layer"] for x in rows if x["mode"] == mode and x["budget"] == budget]
        summary.append({"mode": mode, "budget": budget, "host_ms_per_layer": statistics.median(got),
                        "min": min(got), "max": max(got), "host_cpu_ms_per_layer": statistics.median(cpu),
                        "cuda_calls_per_layer": statistics.median(cuda)})
    machine = {"cpu": cpu_name(), "loadavg": os.getloadavg(), "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "shape": SHAPE, "tokens": args.tokens, "layers": args.layers,
                                    "kernels": args.kernels,
                                    "rows": rows,
                                    "summary": summary}, indent=1))
    print("| mode | GPU budget | host ms a MoE layer, median (range) | on the thread's CPU clock | CUDA calls a MoE "
          "layer |\n|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['mode']} | {s['budget']} | {s['host_ms_per_layer']:.3f} ({s['min']:.3f}-{s['max']:.3f}) | "
              f"{s['host_cpu_ms_per_layer']:.3f} | {s['cuda_calls_per_layer']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
