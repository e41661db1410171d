"""`moetier calibrate`: measure this machine into a hardware profile — O_DIRECT read bandwidth of whole expert
blobs, expert compute time against tokens (t = beta*m + C), and the dense part of a layer and the head."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from moetier.cache.slots import SlotPool
from moetier.engine.batch import StepBatch
from moetier.engine.kv_cache import KVCache
from moetier.model.layers import swiglu
from moetier.model.transformer import Transformer
from moetier.sim.profile import HardwareProfile, Linear, Link
from moetier.store.reader import ExpertReader
from moetier.store.store import Store

USER_PROFILES = Path.home() / ".cache" / "moetier" / "profiles"


def read_bandwidth(store: Store, threads: int = 4, chunk_bytes: int = 2 << 20, num_experts: int = 96) -> float:
    """Bytes/s reading whole expert blobs with O_DIRECT, the way the engine reads them."""
    blobs = random.Random(0).sample(list(store.manifest.blobs), min(num_experts, len(store.manifest.blobs)))
    pool = SlotPool(store.native_layout, min(32, len(blobs)))
    with ExpertReader(store.path, threads, chunk_bytes, verify=False) as reader:
        start = time.perf_counter()
        for i in range(0, len(blobs), pool.num_slots):
            batch = blobs[i:i + pool.num_slots]
            for slot, blob in enumerate(batch):
                reader.submit(blob, pool.views[slot], pool.completions[slot])
            for slot in range(len(batch)):
                pool.completions[slot].wait()
        elapsed = time.perf_counter() - start
    return sum(b.length for b in blobs) / elapsed


def _median_time(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def fit(xs: list[int], ys: list[float]) -> Linear:
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return Linear(max(0.0, float(slope)), max(0.0, float(intercept)))


def expert_compute(store: Store, tokens=(1, 2, 4, 8, 16, 32)) -> Linear:
    spec, dtype = store.spec, store.load_dense()["embed_tokens"].dtype
    # Several experts in rotation, so weights come from memory rather than cache, as in decoding.
    experts = [(torch.randn(2 * spec.moe_intermediate_size, spec.hidden_size).to(dtype),
                torch.randn(spec.hidden_size, spec.moe_intermediate_size).to(dtype)) for _ in range(8)]
    ys = []
    for m in tokens:
        x = torch.randn(m, spec.hidden_size).to(dtype)
        ys.append(_median_time(lambda x=x: [swiglu(x, g, d) for g, d in experts]) / len(experts))
    return fit(list(tokens), ys)


class _DenseOnly:
    """Stands in for the experts: only the shared expert (resident, part of the dense cost) is computed."""

    def __call__(self, layer, x, scores, topk_ids, topk_weights, shared=None):
        return shared() if shared is not None else torch.zeros_like(x)


def dense_and_head(store: Store, tokens=(1, 4, 16), context: int = 48) -> tuple[Linear, Linear]:
    spec = store.spec
    model = Transformer(spec, store.load_dense(), _DenseOnly())
    rows = max(tokens)
    kv = KVCache(spec, rows, context + 1, model.dtype)
    step_s, head_s = [], []
    for t in tokens:
        batch = StepBatch.decode_step([1] * t, list(range(t)), [context - 1] * t, rows)
        step_s.append(_median_time(lambda batch=batch: model.forward(batch, kv)))
        h = torch.randn(t, spec.hidden_size).to(model.dtype)
        head_s.append(_median_time(lambda h=h: torch.nn.functional.linear(h, model.lm_head)))
    head = fit(list(tokens), head_s)
    dense = fit(list(tokens), [(s - head(t)) / spec.num_layers for s, t in zip(step_s, tokens)])
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
    with ExpertReader(store.path, verify=False) as reader:
        executor = ExpertExecutor(spec, store.manifest, n, make_policy("lru"), reader)
        executor.preload(ExpertKey(layer, e) for e in range(n))
        dtype = store.load_dense()["embed_tokens"].dtype
        ys = []
        for t in tokens:
            x = torch.randn(t, spec.hidden_size).to(dtype)
            scores = torch.softmax(torch.randn(t, spec.num_experts), -1)
            ids = torch.stack([torch.randperm(n)[:spec.top_k] for _ in range(t)])  # [t, k], all resident
            w = torch.full((t, spec.top_k), 1.0 / spec.top_k).to(dtype)
            used = len(set(ids.flatten().tolist()))
            ys.append(_median_time(lambda x=x, s=scores, i=ids, w=w: executor(layer, x, s, i, w))
                      - used * expert(t * spec.top_k / used))
    return fit(list(tokens), ys)


def calibrate(store: Store, name: str = "this-machine", threads: int = 4) -> HardwareProfile:
    bandwidth = read_bandwidth(store, threads)
    dense, head = dense_and_head(store)
    expert = expert_compute(store)
    return HardwareProfile(
        name=name, fast_tier_bytes=int(psutil.virtual_memory().available), link=Link(bandwidth),
        expert_compute=expert, dense_s_per_layer=dense, head_s=head,
        executor_s_per_layer=executor_overhead(store, expert),
        expert_bytes=store.native_layout.blob_bytes,
        description=f"measured by `moetier calibrate` on this machine with {store.path.name} "
                    f"({store.manifest.native_precision} experts of {store.native_layout.blob_bytes} bytes)",
        sources=("moetier calibrate: O_DIRECT reads of whole expert blobs, median timings of the model's own "
                 "kernels",))
