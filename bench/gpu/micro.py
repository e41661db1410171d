"""The GPU machine's own numbers, measured before anything of moetier runs there: what the simulator's profile of
it is calibrated from (moetier/sim/profiles/) and what the benchmark's rows are held against.

- the PCIe link: host-to-device copies of one expert (OLMoE-1B-7B's 12 MiB, a small one's 1.5 MiB) and of 1 GiB,
  from pinned and from pageable memory, one at a time and several in flight on one side stream;
- the GPU: one SwiGLU expert of OLMoE's shape (hidden 2048, intermediate 1024) at 1 and 8 tokens, in bf16 and
  from int8/int4/int2 codes, through Triton's kernels (moetier/model/triton_experts.py) and torch's ops
  (`_torch`: dequantize then matmul), with CUDA events; a layer's 8 experts at a token each, both ways and from
  the router's ids on the device (`_routed`); a token's RMSNorm and rotation through Triton and torch's ops, the
  GPU's time and the host's (`_host_s`); a tiny kernel's launch cost; the host's time of each CUDA call the engine
  makes around a copy (`cuda_call_host_s`, named as host_time.py counts them: what the simulator's host thread
  prices a call at);
- the host CPU beside it: the same expert at one token with moetier's native kernels (CPU-assisted compute), and
  with torch's, at the machine's threads;
- the disk: O_DIRECT reads of 12 MiB into pinned memory (the store's reads).

    python bench/gpu/micro.py --out micro.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from moetier.calibrate import median_time

MIB = 1 << 20
COLD_EXPERTS = 48  # 576 MiB of OLMoE-shaped experts


def cuda_time(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median seconds of `fn` on the current stream, by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def link(dev: torch.device) -> dict:
    out = {}
    for label, nbytes in (("expert_12MiB", 12 * MIB), ("expert_1.5MiB", 3 * MIB // 2), ("block_1GiB", 1 << 30)):
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        for kind, pinned in (("pinned", True), ("pageable", False)):
            src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
            s = cuda_time(lambda dst=dst, src=src: dst.copy_(src, non_blocking=True), reps=10 if nbytes > 64 * MIB else 50)
            out[f"h2d_{kind}_{label}_GBps"] = nbytes / s / 1e9
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        s = cuda_time(lambda dst=dst, src=src: src.copy_(dst, non_blocking=True), reps=10 if nbytes > 64 * MIB else 50)
        out[f"d2h_pinned_{label}_GBps"] = nbytes / s / 1e9
    # eight experts in flight on a side stream (what a layer's misses are)
    stream = torch.cuda.Stream(dev)
    srcs = [torch.ones(12 * MIB, dtype=torch.uint8, pin_memory=True) for _ in range(8)]
    dsts = [torch.empty(12 * MIB, dtype=torch.uint8, device=dev) for _ in range(8)]

    def eight():
        with torch.cuda.stream(stream):
            for s, d in zip(srcs, dsts):
                d.copy_(s, non_blocking=True)
        torch.cuda.current_stream().wait_stream(stream)

    out["h2d_pinned_8x12MiB_side_stream_GBps"] = 8 * 12 * MIB / cuda_time(eight, reps=20)
    out["h2d_pinned_8x12MiB_side_stream_GBps"] /= 1e9
    return out


def expert_shapes(h: int = 2048, i: int = 1024) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"gate_up_proj": (torch.randn(2 * i, h, generator=g) * 0.02).bfloat16(),
            "down_proj": (torch.randn(h, i, generator=g) * 0.02).bfloat16()}


def gpu_compute(dev: torch.device) -> dict:
    from moetier.model.expert_kernels import make_expert_kernel
    from moetier.model.kernels import make_kernels
    from moetier.quant.precisions import quantize_expert

    out = {}
    w = expert_shapes()
    kernels = make_kernels("auto", torch.bfloat16, dev)
    for precision in ("bf16", "int8", "int4", "int2", "q4_k"):  # (q4_k: a GGUF's, TritonGgmlExperts)
        tensors = w if precision == "bf16" else quantize_expert(w, precision)
        tensors = {k: t.to(dev) for k, t in tensors.items()}
        kernel = make_expert_kernel(precision, kernels, torch.bfloat16)
        paths = {"": kernel, "_torch": getattr(kernel, "fallback", None)}  # (Triton's, and torch's ops beneath it)
        for suffix, path in paths.items():
            for n in (1, 8) if path is not None else ():
                x = torch.randn(n, 2048, dtype=torch.bfloat16, device=dev)
                y, weights = torch.empty_like(x), torch.ones(n, dtype=torch.bfloat16, device=dev)
                out[f"gpu_expert_{precision}{suffix}_T{n}_s"] = cuda_time(
                    lambda path=path, y=y, x=x, tensors=tensors, weights=weights: path(y, x, tensors, weights))
    out.update(gpu_layer(dev, kernels))
    out.update(gpu_dense(dev, kernels))
    x = torch.zeros(1, device=dev)
    out["gpu_tiny_kernel_s"] = cuda_time(lambda: x.add_(1), reps=200)
    out["gpu_launch_host_s"] = host_time(lambda: x.add_(1))
    return out


def host_time(fn, calls: int = 1000, sync=None) -> float:
    """The host's seconds a call of `fn` (launches queued back to back, the GPU's work waited for once at the end):
    what a step whose host is the slower side pays for it."""
    sync = sync or torch.cuda.synchronize
    for _ in range(10):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls


def cuda_calls(sync=None) -> dict:
    """The host's time of each CUDA call the engine makes around a copy, by host_time.py's names for them: an event
    recorded, queried and waited for (done), a stream made to wait on one, a switch to a side stream and back, the
    time between two events read. `sync`: what waits for the device (torch.cuda.synchronize)."""
    side = torch.cuda.Stream()
    done, start = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    done.record()
    (sync or torch.cuda.synchronize)()

    def switch():
        with torch.cuda.stream(side):
            pass

    calls = {"event.record": lambda: done.record(), "event.query": done.query, "event.synchronize": done.synchronize,
             "stream.wait_event": lambda: side.wait_event(done), "stream switch": switch,
             "event.elapsed_time": lambda: start.elapsed_time(done)}
    return {"cuda_call_host_s": {name: host_time(fn, sync=sync) for name, fn in calls.items()}}


def gpu_dense(dev: torch.device, kernels) -> dict:
    """A decode token's RMSNorm (OLMoE's hidden 2048) and rotation (its 16 query heads of 128) through `kernels`
    (TritonKernels where triton is installed: one launch each, moetier/model/triton_dense.py) and torch's ops (eight
    and seven launches): the GPU's time by CUDA events, and the host's a call."""
    from moetier.config import RopeSpec
    from moetier.model.batch import StepBatch
    from moetier.model.kernels import TorchKernels
    from moetier.model.rope import Rope

    x = torch.randn(1, 2048, dtype=torch.bfloat16, device=dev)
    w = torch.ones(2048, dtype=torch.bfloat16, device=dev)
    q = torch.randn(1, 16, 128, dtype=torch.bfloat16, device=dev)
    tables = Rope(RopeSpec(), 128, 4096, torch.bfloat16, dev).short
    batch = StepBatch.decode_step([1], [0], [100], 1, device=dev)
    out = {}
    for suffix, k in (("", kernels), ("_torch", TorchKernels())):
        for name, call in (("rms_norm", partial(k.rms_norm, x, w, 1e-5)), ("rope", partial(k.rope, tables, q, batch))):
            out[f"gpu_{name}{suffix}_T1_s"] = cuda_time(call)
            out[f"gpu_{name}{suffix}_T1_host_s"] = host_time(call)
    return out


def gpu_layer(dev: torch.device, kernels, k: int = 8) -> dict:
    """A decode token's k experts of one layer (OLMoE's: 8 distinct 12 MiB experts, more than the L2 holds): as the
    planned path computes them (`layer`: Triton's one launch pair, or torch's ops an expert at a time) and as the
    resident path does (`token_routed`: from the router's ids on the device)."""
    out = {}
    for precision in ("bf16", "int4", "q4_k"):
        out.update(layer_paths(dev, kernels, precision, k))
    return out


def layer_paths(dev: torch.device, kernels, precision: str, k: int) -> dict:
    from moetier.model.expert_kernels import make_expert_kernel
    from moetier.quant.precisions import quantize_expert

    out = {}
    kernel = make_expert_kernel(precision, kernels, torch.bfloat16)
    base = expert_shapes()
    one = base if precision == "bf16" else quantize_expert(base, precision)  # (once: q4_k's fit is seconds)
    ws = [{n: t.to(dev).clone() for n, t in one.items()} for _ in range(k)]  # k experts apart in memory
    xs = torch.randn(k, 2048, dtype=torch.bfloat16, device=dev)
    ys, weights = torch.empty_like(xs), torch.full((k,), 0.125, dtype=torch.bfloat16, device=dev)
    items = [(w, e, e + 1) for e, w in enumerate(ws)]
    for suffix, path in {"": kernel, "_torch": getattr(kernel, "fallback", None)}.items():
        if path is not None:
            out[f"gpu_layer{k}_{precision}{suffix}_T1_s"] = cuda_time(partial(path.layer, ys, xs, weights, items))
    if hasattr(kernel, "tiles"):  # the host's time a Triton call (its table built and copied, its two launches:
        # host_time.py --kernels triton's "table copy" and two "triton launch"), what a routed layer pays a precision;
        # a hundred back to back, so the launch queue never fills and makes the host wait for the device
        out[f"gpu_layer{k}_{precision}_T1_host_s"] = host_time(partial(kernel.layer, ys, xs, weights, items), calls=100)
    if hasattr(kernel, "tiles"):  # the Triton kernels' untuned tile against a few others
        from moetier.model.triton_experts import Tiles

        for n, kk in ((32, 64), (32, 128), (64, 128), (16, 256)):
            other = kernel.with_tiles(Tiles(n, kk))
            out[f"gpu_layer{k}_{precision}_tiles{n}x{kk}_T1_s"] = cuda_time(partial(other.layer, ys, xs, weights,
                                                                                   items))
    table = kernel.token_table(ws) if hasattr(kernel, "token_routed") else None
    if table is not None and table.device is not None:
        ids, y = torch.arange(k, device=dev)[None], torch.empty(1, 2048, dtype=torch.bfloat16, device=dev)
        out[f"gpu_layer{k}_{precision}_routed_T1_s"] = cuda_time(
            partial(kernel.token_routed, y, xs[:1], ids, weights[None], table))
    return out


def cpu_compute(h: int = 2048, i: int = 1024, cold: int = COLD_EXPERTS) -> dict:
    """One (h, i) expert on the host's cores at one token: warm, and cold from `cold` experts in rotation."""
    from moetier.model.expert_kernels import make_expert_kernel
    from moetier.model.kernels import make_kernels

    out = {"cpu_threads": torch.get_num_threads()}
    w = expert_shapes(h, i)
    x = torch.randn(1, h, dtype=torch.bfloat16)
    y, weights = torch.empty_like(x), torch.ones(1, dtype=torch.bfloat16)
    # cold: experts in rotation, more bytes than any last-level cache, as CPU-assisted compute meets them
    many = [{k: t.clone() for k, t in w.items()} for _ in range(cold)]
    for name in ("auto", "torch"):
        kernels = make_kernels(name, torch.bfloat16, torch.device("cpu"))
        kernel = make_expert_kernel("bf16", kernels, torch.bfloat16)
        out[f"cpu_expert_bf16_T1_{kernels.name}_warm_s"] = median_time(lambda kernel=kernel: kernel(y, x, w, weights))
        turn = iter(range(1 << 30))
        out[f"cpu_expert_bf16_T1_{kernels.name}_cold_s"] = median_time(
            lambda kernel=kernel, turn=turn: kernel(y, x, many[next(turn) % cold], weights), repeats=2 * cold)
    return out


def disk(folder: Path, nbytes: int = 12 * MIB, count: int = 64) -> dict:
    """O_DIRECT reads of `count` blobs of `nbytes` from a file written (and synced) for the purpose."""
    path = folder / "moetier-disk-probe.bin"
    with open(path, "wb") as f:
        block = os.urandom(MIB)
        for _ in range(nbytes * count // MIB):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, nbytes)
        start = time.perf_counter()
        for i in range(count):
            os.preadv(fd, [buf], i * nbytes)
        elapsed = time.perf_counter() - start
        os.close(fd)
        return {"disk_odirect_12MiB_GBps": nbytes * count / elapsed / 1e9}
    finally:
        path.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--disk-dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    steps = [("cpu", cpu_compute), ("disk", lambda: disk(args.disk_dir))]
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        steps = [("link", lambda: link(dev)), ("gpu", lambda: gpu_compute(dev)), ("cuda_calls", cuda_calls), *steps]
    for name, step in steps:
        try:
            result.update(step())
        except Exception as e:  # one part failing leaves the others' numbers
            result[f"{name}_error"] = f"{type(e).__name__}: {e}"
        args.out.write_text(json.dumps(result, indent=1))
    for k, v in result.items():
        print(f"{k:45s} {v:.4g}" if isinstance(v, float) else f"{k:45s} {v}")


if __name__ == "__main__":
    main()
