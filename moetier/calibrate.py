"""`moetier calibrate`: measure this machine into a hardware profile for the simulator. It runs the real engine,
so it sits above both executors.

- the disk: O_DIRECT reads of the model's expert blobs through the engine's own reader, queued (bandwidth) and
  alone (latency);
- the CPU as a roofline device (memory bandwidth from a large matrix-vector product, throughput from a large
  matrix product, each quantized precision's from its expert kernel, the per-call overhead from a tiny one), for
  shapes not measured;
- for the given model's shape: expert compute at 1-32 tokens (measured points) at the model's precision and at each
  quantized copy the store holds (those kernels unpack codes: the roofline would flatter them), the dense part of
  a layer and the head, the executor's own per-layer work, a predictor's per-layer work, and a whole decode step of
  the engine with every expert resident (its layer-by-layer path), to which those parts are anchored.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from dataclasses import dataclass

import psutil
import torch

from moetier.engine.huge_pages import private_mapping
from moetier.engine.slots import HostSlots
from moetier.model.batch import StepBatch
from moetier.model.build import make_model
from moetier.model.expert_kernels import make_expert_kernel
from moetier.model.kernels import TorchKernels, make_kernels
from moetier.model.kv_cache import KVCache
from moetier.predict.base import Predictor
from moetier.progress import tqdm
from moetier.sim.cost import CostModel, linear_fit
from moetier.sim.profile import Device, HardwareProfile, Linear, Measured, Piecewise, Tier, piecewise
from moetier.sim.shapes import ModelShape
from moetier.store.format import ALIGN, BlobRef, Segment
from moetier.store.reader import Completion, ExpertReader
from moetier.store.store import Store


def median_time(fn, repeats: int = 7, warm_up_s: float = 0.0) -> float:
    """Seconds per call of `fn`: the median of `repeats` timed calls after untimed ones (one, or as many as fill
    `warm_up_s`)."""
    end = time.perf_counter() + warm_up_s
    fn()
    while time.perf_counter() < end:
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def disk_tier(store: Store, threads: int = 4, chunk_bytes: int = 2 << 20, reads: int = 16) -> Tier:
    """The disk as the engine reads it (O_DIRECT whole blobs through its reader): a queued read's time from `reads`
    blobs submitted at once, as a layer's misses are (the reader threads never idle) — and, where the model's blobs
    are small, from as many larger spans of the same files, so that time splits into bytes over a bandwidth and a
    cost per request (`per_read_s`) and carries over to other models' experts; latency from blobs read alone (a
    single miss), as what such a read takes beyond its time queued; the process's CPU time per byte over the queued
    reads (the reader's threads and syscalls: what a read takes from the compute on the same cores). Every blob read
    once, unverified (the engine checks a blob's first read only)."""
    # the model's own precision only: a store with quantized copies holds blobs of a quarter the size, and a lone
    # read's time less the wrong blob's share of the bandwidth is no latency (a median over 8 bf16 and 8 int4 lone
    # reads, less an int4 blob's transfer, put demo-deep-xl's at ~1.9 ms)
    native = [b for b in store.manifest.blobs if b.precision == store.manifest.native_precision]
    blobs = random.Random(0).sample(native, min(len(native), 2 * reads))
    alone, queued = blobs[:len(blobs) // 2], blobs[len(blobs) // 2:]
    pool = HostSlots(store.native_layout, len(queued))
    spans = larger_spans(store, blobs[0], SPANS)
    with ExpertReader(store.path, threads, chunk_bytes, verify=False, manifest=store.manifest) as reader:
        def read(batch, views, completions) -> tuple[float, float]:
            start, cpu = time.perf_counter(), time.process_time()
            for blob, view, done in zip(batch, views, completions):
                reader.submit(blob, view, done)
            for done in completions:
                done.wait()
            return time.perf_counter() - start, time.process_time() - cpu

        single = statistics.median(read([b], pool.views[:1], pool.completions[:1])[0] for b in alone)
        seconds, cpu = read(queued, pool.views, pool.completions)
        total = sum(b.length for b in queued)
        bandwidth, per_read = total / seconds, 0.0
        if spans:
            buffers = [private_mapping(b.length) for b in spans]  # huge pages, touched first, as the engine's slots:
            for buffer in buffers:  # O_DIRECT into fresh 4 KiB pages read 8 MiB spans at 1.3-1.9 GB/s on a Zen 5
                buffer.write(bytes(len(buffer)))  # guest whose disk gave 3.5 into these
            views, completions = [memoryview(m) for m in buffers], [Completion() for _ in spans]
            big = statistics.median(read(spans, views, completions)[0] for _ in range(3))  # (~10 ms each: noisy)
            small_s, big_s = seconds / len(queued), big / len(spans)  # a queued read's time at each size
            size = total / len(queued)
            if big_s > small_s:  # (else noise: keep the one size's figure)
                bandwidth = (spans[0].length - size) / (big_s - small_s)
                per_read = max(0.0, small_s - size / bandwidth)
    queued_s = per_read + blobs[0].length / bandwidth
    return Tier("disk (O_DIRECT)", bandwidth, max(0.0, single - queued_s), cpu_s_per_byte=cpu / total,
                per_read_s=per_read)


SPAN_BYTES = 16 << 20  # the larger reads' size, at most (a real model's expert: 6-24 MiB in bf16)
SPANS = 8  # of them at once (demo-fine's 34 MB checkpoint: 4 MiB each)


def larger_spans(store: Store, blob: BlobRef, count: int) -> list[BlobRef]:
    """`count` reads of one size from `blob`'s file (a store's own, or the checkpoint a linked store reads), at
    least 4x the blob's and at most SPAN_BYTES, side by side from its start; none where the model's blobs are
    that large already or the file is too small to hold them."""
    if blob.linked:
        segment = blob.segments[0]
        file_bytes = store.manifest.sources[segment.source].size
    else:
        file_bytes = (store.path / blob.file).stat().st_size
    size = min(SPAN_BYTES, file_bytes // count) // ALIGN * ALIGN
    if size < 4 * blob.length:
        return []
    if blob.linked:
        return [dataclasses.replace(blob, expert=-1 - i, offset=0, length=size, crc32=0,
                                    segments=(Segment(segment.source, i * size, size, 0),)) for i in range(count)]
    return [dataclasses.replace(blob, expert=-1 - i, offset=i * size, length=size, crc32=0) for i in range(count)]


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
        took = time.perf_counter() - start
        if took >= long_enough_s or n >= largest:  # (a product of 0.2 s or more: the median of three)
            return 2 * n ** 3 / median_time(lambda a=a, b=b: a @ b, 3 if took >= 4 * long_enough_s else 5)
        n *= 2


def cpu_device(dtype: torch.dtype = torch.bfloat16) -> Device:
    """The CPU as a roofline: bytes/s of a matrix-vector product over 256 MiB of weights, FLOP/s of a square
    matrix product, and the time of a tiny call."""
    precision = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    linear = cpu_kernels(dtype).linear
    w = torch.full((8192, 16384), 0.01, dtype=dtype)  # (a product streams any values alike: filled, not drawn —
    # 0.1 s where 134M random draws took 1.1-1.3 s of a calibration's ~5)
    v = torch.randn(1, 16384).to(dtype)
    bandwidth = w.numel() * w.element_size() / median_time(lambda: linear(v, w), 5)
    flops = matmul_flops(dtype)
    s, t = torch.randn(1, 64).to(dtype), torch.randn(64, 64).to(dtype)
    overhead = median_time(lambda: [s @ t for _ in range(100)]) / 100
    return Device("cpu", bandwidth, {precision: flops, **quantized_flops(dtype)}, overhead)


def quantized_flops(dtype: torch.dtype, hidden: int = 1024, intermediate: int = 2048,
                    copies: int = 16) -> dict[str, float]:
    """Each quantized precision's throughput on this CPU, as decoding meets it: a one-token SwiGLU expert through
    the engine's kernel for it, over `copies` random experts in rotation (50-100 MiB: from memory, not cache, as
    expert_curves times them). A shape calibration did not measure is priced by it at a quantized precision
    (`moetier doctor` on HOBBIT's int4 copies), which it otherwise could not be at all. One token's rate: an expert
    over many tokens unpacks its codes once for them all, so a prefill is priced high."""
    from moetier.quant.codes import BITS, quantize_expert

    x, out, weights = torch.randn(1, hidden).to(dtype), torch.empty(1, hidden, dtype=dtype), torch.ones(1, dtype=dtype)
    floats = {"gate_up_proj": torch.randn(2 * intermediate, hidden) / hidden ** 0.5,
              "down_proj": torch.randn(hidden, intermediate) / intermediate ** 0.5}
    flop = 2 * 3 * hidden * intermediate  # (SwiGLU: gate, up and down; one token)
    kernels, rates = cpu_kernels(dtype), {}
    for precision in BITS:
        kernel, w = make_expert_kernel(precision, kernels, dtype), quantize_expert(floats, precision)
        # A kernel that takes milliseconds an expert computes (torch's fallback, which unpacks every code to floats:
        # an fp32 model's, 8-35 ms here) and where its 1.5-6 MiB of codes come from does not show: two copies, not
        # sixteen (which took 5-12 s of a calibration, for a rate no less right)
        slow = median_time(lambda kernel=kernel, w=w: kernel(out, x, w, weights), 1) > 2e-3
        experts = [{name: t.clone() for name, t in w.items()} for _ in range(2 if slow else copies)]

        def rotation(kernel=kernel, experts=experts) -> None:
            for e in experts:
                kernel(out, x, e, weights)

        rates[precision] = flop * len(experts) / median_time(rotation, 7, 0.05)
    return rates


EXPERT_TOKENS = (1, 2, 3, 4, 6, 8, 16, 32)  # decode's few tokens an expert closely, prefill's more coarsely


def expert_curves(store: Store, precisions: list[str], tokens=EXPERT_TOKENS, rounds: int = 3) -> dict[str, Piecewise]:
    """One expert's compute against its tokens at each of `precisions` (the model's own and its quantized copies,
    from the store's real blobs): the measured points, straight lines between them (not one line through all: see
    Piecewise). The precisions are timed in turn within each round and each point is the median over rounds, so
    this machine's drift (its memory streamed 27-63 GB/s within an hour) touches them alike: a
    mixed-precision plan is priced by their ratio."""
    spec, dtype = store.spec, store.load_dense()["embed_tokens"].dtype
    # Several experts in rotation, so weights come from memory rather than cache, as in decoding; the store's own,
    # read into slots the engine's way (anonymous mappings advised for huge pages: ~15% faster to stream than
    # fresh tensors on the Zen 4 this was measured on, 0.32 against 0.37 ms an expert of demo-deep-xl).
    kernels = {p: make_expert_kernel(p, cpu_kernels(dtype), dtype, spec) for p in precisions}
    experts = {p: stored_experts(store, p, 8) for p in precisions}
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds):
        for m in tokens:
            x, out = torch.randn(m, spec.hidden_size).to(dtype), torch.empty(m, spec.hidden_size, dtype=dtype)
            weights = torch.ones(m, dtype=dtype)
            for p in precisions:
                def rotation(kernel=kernels[p], slots=experts[p], x=x, out=out, w=weights) -> None:
                    for e in slots:
                        kernel(out, x, e, w)

                # (warmed up first: the first ~0.2 s of a kernel after idling ran up to 40% slower here; once, at
                # its first point — each point after it follows the kernel's own work, and 0.2 s at each of the
                # eight took 1.6 s of a precision's 1.8)
                first = r == 0 and m == tokens[0]
                seconds = median_time(rotation, 11, 0.2 if first else 0.0) / len(experts[p])
                times.setdefault((p, m), []).append(seconds)
    return {p: piecewise(tokens, [statistics.median(times[p, m]) for m in tokens]) for p in precisions}


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


def executor_overhead(store: Store, expert: Piecewise, tokens=(1, 8)) -> Linear:
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


class _TimedPredictor(Predictor):
    """A predictor whose scoring is timed where the engine runs it (between a layer's routing and its plan): timed
    alone the stacked-gates predictor took 0.03 ms a layer of demo-deep-xl here, inside the engine 0.12-0.21 (its
    small product wakes torch's threads beside the kernels')."""

    def __init__(self, inner: Predictor) -> None:
        super().__init__(inner.moe_layers, inner.num_experts, inner.top_k, inner.distance)
        self.inner, self.seconds, self.calls = inner, 0.0, 0

    def on_sequence_start(self) -> None:
        self.inner.on_sequence_start()

    def observe(self, layer: int, gate_input, route) -> None:
        self.inner.observe(layer, gate_input, route)

    def predict(self, layer: int, gate_input):
        start = time.perf_counter()
        out = self.inner.predict(layer, gate_input)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out


@dataclass(frozen=True)
class DecodeStep:
    """A batch-1 decode step of the real engine with every expert resident, through the executor's layer by layer
    path (routing hand-off, planning, grouping, policy events): the path every budget below 100% takes, and the one
    the simulator times. (A fully resident engine skips it — 41-46 against 47-56 ms a token on demo-deep-xl here.)"""

    tpot_s: float  # less the predictor's scoring, where one ran
    expert_s: float  # one expert's compute inside it, by the executor's clock (a layer's experts in one call)
    predict_s: float = 0.0  # the predictor's scoring a MoE layer, where one ran

    def __post_init__(self) -> None:
        if not (self.tpot_s > 0 and self.expert_s > 0 and self.predict_s >= 0):
            raise ValueError(f"a decode step needs positive times, got {self}")


def decode_step(store: Store, mode: str = "native", tokens: int = 64, predictor: str = "none") -> DecodeStep:
    """`DecodeStep` of `store` with its experts at precision `mode` ("native", or a copy the store holds), with
    `predictor` scoring the coming layers (under HOBBIT's prefetch, which at 100% finds them all resident)."""
    from moetier.engine.engine import Engine
    from moetier.plan.precision import MixedPrecision
    from moetier.plan.step import LayerHook

    engine = Engine.from_pretrained(str(store.path), expert_memory="100%", precision=MixedPrecision(mode),
                                    prefetch="none" if predictor == "none" else "hobbit", predictor=predictor,
                                    progress=False)
    with engine:
        engine.preload()
        layer_step = engine.executor.layer_step
        layer_step.hooks.append(LayerHook())  # an observer: every layer is planned, as below 100%
        timed = layer_step.predictor = _TimedPredictor(layer_step.predictor) if layer_step.predictor else None
        prompt = [random.Random(1).randrange(store.spec.vocab_size)]  # (one token: every step computes 1 an expert)
        engine.generate([prompt], max_new_tokens=8, ignore_eos=True)  # warm-up
        costs = engine.executor.costs
        count, total = costs.experts_computed, costs.expert_s_total
        scored, calls = (timed.seconds, timed.calls) if timed else (0.0, 0)
        tpot = engine.generate([prompt], max_new_tokens=tokens, ignore_eos=True).stats["tpot_s"]
        expert_s = (costs.expert_s_total - total) / max(1, costs.experts_computed - count)
        if timed is None:
            return DecodeStep(tpot, expert_s)
        seconds = timed.seconds - scored  # over `tokens` forward steps of one token (the prompt's one among them)
        return DecodeStep(tpot - seconds / tokens, expert_s, seconds / max(1, timed.calls - calls))


def anchored(profile: HardwareProfile, shape: ModelShape, expert_bytes: int,
             steps: dict[str, DecodeStep]) -> HardwareProfile:
    """`profile` anchored to the engine's decode steps (`steps`: by precision, the model's own among them). Kernels
    timed alone are not what they cost inside the step (on demo-deep-xl here 0.22 ms an expert alone, 0.35 in the
    step: the step's experts are wherever routing sends it in 9 GiB, and this machine's memory moved 27-63 GB/s
    from one minute to the next), so each precision's expert curve is scaled to its cost in the step (one measured
    a precision's curve; the model's own ratio for a precision without one); what the step then leaves unexplained
    (the generate loop's own work: planning, sampling, KV bookkeeping) is the executor's fixed cost per MoE layer.
    Growth with tokens stays the isolated measurements'."""
    native = steps[shape.precision]
    own = profile.measured_for(shape.hidden_size, shape.moe_intermediate_size, shape.precision)
    ratio = native.expert_s / own.expert_s(1)
    measured = tuple(dataclasses.replace(m, expert_s=m.expert_s.scaled(
        steps[m.precision].expert_s / m.expert_s(1) if m.precision in steps else ratio)) for m in profile.measured)
    profile = dataclasses.replace(profile, measured=measured)
    parts = CostModel.of(profile, shape, shape.precision, expert_bytes)
    decoder = range(shape.encoder_layers, shape.num_layers)  # (what a decode step runs)
    moe = [layer for layer in shape.moe_layers if layer in decoder]
    ex = profile.executor_s_per_layer
    rest = native.tpot_s - (sum(parts.resident_layer_s(layer, 1) for layer in decoder) + parts.head_s(1))
    at_one = max(0.0, ex(1) + rest / len(moe))  # the executor's work a layer at one token: what the step leaves
    per_token = min(ex.per_token, at_one)  # (its growth with tokens as measured, never below zero at one token)
    return dataclasses.replace(profile, executor_s_per_layer=Linear(per_token, at_one - per_token))


def calibrate(store: Store, name: str = "this-machine", threads: int = 4, progress: bool = True) -> HardwareProfile:
    spec, precision = store.spec, store.manifest.native_precision
    shape = ModelShape.from_spec(spec, store.path.name, precision)
    quantized = [p for p in store.manifest.precisions if p != precision]
    with tqdm(total=5 + 1 + len(quantized), desc="calibrate", unit="step", disable=not progress, leave=False) as bar:
        def step(label: str, fn, *args):
            bar.set_postfix_str(label)
            out = fn(*args)
            bar.update()
            return out

        disk = step("disk", disk_tier, store, threads)
        device = step("cpu roofline", cpu_device, store.load_dense()["embed_tokens"].dtype)
        dense, head = step("dense layers", dense_and_head, store)
        curves = step("experts", expert_curves, store, [precision, *quantized])
        executor = step("executor", executor_overhead, store, curves[precision])
        scorer = "stacked-gates" if spec.encoder_decoder is None else "none"  # (measured on the model's own step)
        steps = {p: step(f"decode step {p}", decode_step, store, "native" if p == precision else p, 64,
                         scorer if p == precision else "none") for p in [precision, *quantized]}
    own = Measured(spec.hidden_size, spec.moe_intermediate_size, precision, curves.pop(precision), dense, head)
    profile = HardwareProfile(
        name=name, fast_tier_bytes=int(psutil.virtual_memory().available), tiers=(disk,), devices={"cpu": device},
        compute_device="cpu", executor_s_per_layer=executor,
        predict_s_per_layer=Linear(0.0, steps[precision].predict_s),
        measured=(own, *(dataclasses.replace(own, precision=p, expert_s=fit) for p, fit in curves.items())),
        description=f"this machine, measured by `moetier calibrate --model {store.path.name}`",
        sources=("moetier calibrate: single O_DIRECT reads through the engine's reader; median timings of the "
                 "model's own kernels, their sum anchored to a whole decode step of the engine; the CPU roofline "
                 "from large matrix products",))
    return anchored(profile, shape, store.native_layout.blob_bytes, steps)
