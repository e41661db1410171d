"""`moetier calibrate`: measure this machine into a hardware profile for the simulator. It runs the real engine,
so it sits above both executors.

- the disk: O_DIRECT reads of the model's expert blobs through the engine's own reader, queued (bandwidth) and
  alone (latency);
- the CPU as a roofline device (memory bandwidth from a large matrix-vector product, throughput from a large
  matrix product, the per-call overhead from a tiny one), for shapes not measured;
- for the given model's shape: expert compute against tokens (t = beta*m + C) at the model's precision and at each
  quantized copy the store holds (those kernels unpack codes: the roofline would flatter them), the dense part of
  a layer and the head, the executor's own per-layer work, and what a whole resident decode step costs beyond
  those parts.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time

import psutil
import torch
from tqdm import tqdm

from moetier.engine.slots import HostSlots
from moetier.model.batch import StepBatch
from moetier.model.build import make_model
from moetier.model.expert_kernels import make_expert_kernel
from moetier.model.kernels import TorchKernels, make_kernels
from moetier.model.kv_cache import KVCache
from moetier.sim.cost import CostModel, linear_fit
from moetier.sim.profile import Device, HardwareProfile, Linear, Measured, Tier
from moetier.sim.shapes import ModelShape
from moetier.store.reader import ExpertReader
from moetier.store.store import Store


def median_time(fn, repeats: int = 7) -> float:
    """Seconds per call of `fn`: the median of `repeats` timed calls after one untimed (warm-up) call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def disk_tier(store: Store, threads: int = 4, chunk_bytes: int = 2 << 20, reads: int = 16) -> Tier:
    """The disk as the engine reads it (O_DIRECT whole blobs through its reader): bandwidth from `reads` blobs
    submitted at once, as a layer's misses are (the reader threads never idle); latency from blobs read alone
    (a single miss), as what such a read takes beyond its share of that bandwidth; the process's CPU time per
    byte over the queued reads (the reader's threads and syscalls: what a read takes from the compute on the
    same cores). Every blob read once, unverified (the engine checks a blob's first read only)."""
    blobs = random.Random(0).sample(list(store.manifest.blobs), min(len(store.manifest.blobs), 2 * reads))
    alone, queued = blobs[:len(blobs) // 2], blobs[len(blobs) // 2:]
    pool = HostSlots(store.native_layout, len(queued))
    with ExpertReader(store.path, threads, chunk_bytes, verify=False, manifest=store.manifest) as reader:
        def read(batch) -> tuple[float, float]:
            start, cpu = time.perf_counter(), time.process_time()
            for slot, blob in enumerate(batch):
                reader.submit(blob, pool.views[slot], pool.completions[slot])
            for slot in range(len(batch)):
                pool.completions[slot].wait()
            return time.perf_counter() - start, time.process_time() - cpu

        single = statistics.median(read([b])[0] for b in alone)
        seconds, cpu = read(queued)
        total = sum(b.length for b in queued)
        bandwidth = total / seconds
    return Tier("disk (O_DIRECT)", bandwidth, max(0.0, single - blobs[0].length / bandwidth),
                cpu_s_per_byte=cpu / total)


def cpu_kernels(dtype: torch.dtype) -> TorchKernels:
    """The kernels the engine runs on this CPU by default: what calibration must time."""
    return make_kernels("auto", dtype, torch.device("cpu"))


def matmul_flops(dtype: torch.dtype, largest: int = 2048, long_enough_s: float = 0.05) -> float:
    """FLOP/s of an n-cubed matrix product, n doubled from 256 while a product takes under `long_enough_s`, up
    to `largest`. Where there is no fast path for the dtype (bf16 without AVX512-BF16 or AMX: one 2048-cubed
    bf16 product takes ~30 s on an AVX2 CPU) a small n already takes long enough, and calibration stays short."""
    n = 256
    while True:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        start = time.perf_counter()
        a @ b
        if time.perf_counter() - start >= long_enough_s or n >= largest:
            return 2 * n ** 3 / median_time(lambda a=a, b=b: a @ b, 5)
        n *= 2


def cpu_device(dtype: torch.dtype = torch.bfloat16) -> Device:
    """The CPU as a roofline: bytes/s of a matrix-vector product over 256 MiB of weights, FLOP/s of a square
    matrix product, and the time of a tiny call."""
    precision = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    linear = cpu_kernels(dtype).linear
    w = torch.randn(8192, 16384).to(dtype)
    v = torch.randn(1, 16384).to(dtype)
    bandwidth = w.numel() * w.element_size() / median_time(lambda: linear(v, w), 5)
    flops = matmul_flops(dtype)
    s, t = torch.randn(1, 64).to(dtype), torch.randn(64, 64).to(dtype)
    overhead = median_time(lambda: [s @ t for _ in range(100)]) / 100
    return Device("cpu", bandwidth, {precision: flops}, overhead)


def expert_compute(store: Store, tokens=(1, 2, 4, 8, 16, 32), precision: str | None = None) -> Linear:
    """One expert's compute against its tokens, at `precision` (default: the model's own; a quantized copy's from
    its real blobs)."""
    spec, dtype = store.spec, store.load_dense()["embed_tokens"].dtype
    precision = precision or store.manifest.native_precision
    kernel = make_expert_kernel(precision, cpu_kernels(dtype), dtype, spec)
    # Several experts in rotation, so weights come from memory rather than cache, as in decoding.
    if precision == store.manifest.native_precision:
        experts = [{name: torch.randn(shape).to(dtype) for name, shape in spec.expert_shapes} for _ in range(8)]
    else:
        experts = stored_experts(store, precision, 8)
    ys = []
    for m in tokens:
        x, out, weights = torch.randn(m, spec.hidden_size).to(dtype), torch.empty(m, spec.hidden_size, dtype=dtype), \
            torch.ones(m, dtype=dtype)
        ys.append(median_time(lambda x=x, out=out, w=weights: [kernel(out, x, e, w) for e in experts]) / len(experts))
    return linear_fit(list(tokens), ys)


def stored_experts(store: Store, precision: str, count: int) -> list[dict]:
    """The first `count` experts' `precision` copies, read from the store into host slots (the kernels' inputs)."""
    keys = store.spec.expert_keys()[:count]
    pool = HostSlots(store.manifest.precisions[precision], len(keys))
    with ExpertReader(store.path, 2, 2 << 20, verify=False, manifest=store.manifest) as reader:
        for slot, (layer, e) in enumerate(keys):
            reader.submit(store.manifest.blob(layer, e, precision), pool.views[slot], pool.completions[slot])
        for slot in range(len(keys)):
            pool.completions[slot].wait()
    return [pool.weights(slot) for slot in range(len(keys))]


class _DenseOnly:
    """Stands in for the experts: only the shared expert (resident, part of the dense cost) is computed."""

    def __call__(self, layer, x, scores, topk_ids, topk_weights, shared=None):
        return shared() if shared is not None else torch.zeros_like(x)


def dense_and_head(store: Store, tokens=(1, 4, 16), context: int = 48) -> tuple[Linear, Linear]:
    spec, dense = store.spec, store.load_dense()
    model = make_model(spec, dense, _DenseOnly(), cpu_kernels(dense["embed_tokens"].dtype))
    rows = max(tokens)
    kv = KVCache(spec, rows, context + 1, model.dtype)
    kv.encoder_lengths = [context // 2] * rows  # (an encoder-decoder's decoder attends to a prompt this long)
    step_s, head_s = [], []
    for t in tokens:
        batch = StepBatch.decode_step([1] * t, list(range(t)), [context - 1] * t, rows)
        step_s.append(median_time(lambda batch=batch: model.forward(batch, kv)))
        h = torch.randn(t, spec.hidden_size).to(model.dtype)
        head_s.append(median_time(lambda h=h: model.kernels.linear(h, model.lm_head)))
    head = linear_fit(list(tokens), head_s)
    dense = linear_fit(list(tokens), [(s - head(t)) / spec.num_layers for s, t in zip(step_s, tokens)])
    return dense, head


def executor_overhead(store: Store, expert: Linear, tokens=(1, 8)) -> Linear:
    """The real executor's own cost per MoE layer (routing hand-off, planning, grouping, policy events) on a
    layer whose experts are all resident, less their compute."""
    from moetier.cache.keys import ExpertKey
    from moetier.cache.policies import make_policy
    from moetier.engine.expert_executor import ExpertExecutor

    spec = store.spec
    n = min(spec.num_experts, 2 * spec.top_k)
    layer = spec.moe_layers[0]
    with ExpertReader(store.path, verify=False, manifest=store.manifest) as reader:
        dtype = store.load_dense()["embed_tokens"].dtype
        executor = ExpertExecutor(spec, store.manifest, n * store.native_layout.blob_bytes, make_policy("lru"),
                                  reader, kernels=cpu_kernels(dtype))
        executor.preload(ExpertKey(layer, e) for e in range(n))
        ys = []
        for t in tokens:
            x = torch.randn(t, spec.hidden_size).to(dtype)
            scores = torch.softmax(torch.randn(t, spec.num_experts), -1)
            ids = torch.stack([torch.randperm(n)[:spec.top_k] for _ in range(t)])  # [t, k], all resident
            w = torch.full((t, spec.top_k), 1.0 / spec.top_k).to(dtype)
            used = len(set(ids.flatten().tolist()))
            ys.append(median_time(lambda x=x, s=scores, i=ids, w=w: executor(layer, x, s, i, w))
                      - used * expert(t * spec.top_k / used))
    return linear_fit(list(tokens), ys)


def resident_step_s(store: Store, tokens: int = 96) -> float:
    """TPOT of the real engine at batch 1 with every expert resident."""
    from moetier.engine.engine import Engine

    engine = Engine.from_pretrained(str(store.path), expert_memory="100%", progress=False)
    with engine:
        engine.preload()
        prompt = [random.Random(1).randrange(store.spec.vocab_size) for _ in range(16)]
        engine.generate([prompt], max_new_tokens=8, ignore_eos=True)  # warm-up
        return engine.generate([prompt], max_new_tokens=tokens, ignore_eos=True).stats["tpot_s"]


def calibrate(store: Store, name: str = "this-machine", threads: int = 4, progress: bool = True) -> HardwareProfile:
    spec, precision = store.spec, store.manifest.native_precision
    shape = ModelShape.from_spec(spec, store.path.name, precision)
    quantized = [p for p in store.manifest.precisions if p != precision]
    with tqdm(total=6 + len(quantized), desc="calibrate", unit="step", disable=not progress, leave=False) as bar:
        def step(label: str, fn, *args):
            bar.set_postfix_str(label)
            out = fn(*args)
            bar.update()
            return out

        disk = step("disk", disk_tier, store, threads)
        device = step("cpu roofline", cpu_device, store.load_dense()["embed_tokens"].dtype)
        dense, head = step("dense layers", dense_and_head, store)
        expert = step("experts", expert_compute, store)
        executor = step("executor", executor_overhead, store, expert)
        resident = step("resident step", resident_step_s, store)
        copies = {p: step(f"experts {p}", expert_compute, store, (1, 2, 4, 8, 16, 32), p) for p in quantized}
    profile = HardwareProfile(
        name=name, fast_tier_bytes=int(psutil.virtual_memory().available), tiers=(disk,), devices={"cpu": device},
        compute_device="cpu", executor_s_per_layer=executor,
        measured=(Measured(spec.hidden_size, spec.moe_intermediate_size, precision, expert, dense, head),),
        description=f"this machine, measured by `moetier calibrate --model {store.path.name}`",
        sources=("moetier calibrate: single O_DIRECT reads through the engine's reader; median timings of the "
                 "model's own kernels; the CPU roofline from large matrix products",))
    # Kernels timed alone run in warm caches and miss the generate loop's own work (sampling, KV bookkeeping):
    # set the dense layer's fixed cost so that a resident step costs what the real engine's does. Its growth
    # per token stays the isolated measurement's.
    parts = CostModel.of(profile, shape, precision, store.native_layout.blob_bytes)
    modelled = sum(parts.resident_layer_s(layer, 1) for layer in range(spec.num_layers)) + parts.head_s(1)
    fixed = max(0.0, dense.fixed + (resident - modelled) / spec.num_layers)
    measured = dataclasses.replace(profile.measured[0], dense_s_per_layer=Linear(dense.per_token, fixed))
    also = tuple(dataclasses.replace(measured, precision=p, expert_s=fit) for p, fit in copies.items())
    return dataclasses.replace(profile, measured=(measured, *also))
