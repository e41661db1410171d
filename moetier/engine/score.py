"""Teacher-forced scoring in the engine: the next-token distributions a configuration computes for a given text,
fed as generation feeds it — a short prefill, then one decode step per token at batch 1 — so every plan (which
experts are read, at which precision, which are skipped) is the one a user's decode would get."""

from __future__ import annotations

import time

import torch

from moetier.engine.stats import GenerationStats
from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.plan.route import DECODE, PREFILL


def teacher_forced(engine, ids: list[int], prefix: int) -> tuple[torch.Tensor, GenerationStats]:
    """Log-probabilities [len(ids) - prefix, V] (fp32) of the distribution each token from position `prefix` on
    was predicted from, and the run's statistics (decode step times, reads, hits)."""
    if not 0 < prefix < len(ids):
        raise ValueError(f"prefix {prefix} must leave tokens to score in a window of {len(ids)}")
    model, executor = engine.model, engine.executor
    kv = KVCache(model.spec, 1, len(ids), model.dtype, model.device)
    stats = GenerationStats(prompt_tokens=prefix)
    executor.layer_step.on_sequence_start()
    out = torch.empty(len(ids) - prefix, model.spec.vocab_size, dtype=torch.float32)
    executor.begin_step(PREFILL, stats.phases)
    out[0] = model.forward(StepBatch.prefill([ids[:prefix]], [0], device=model.device), kv)[0].float()
    for j in range(prefix, len(ids) - 1):
        t0 = time.perf_counter()
        executor.begin_step(DECODE, stats.phases)
        logits = model.forward(StepBatch.decode_step([ids[j]], [0], [j], 1, device=model.device), kv)
        out[j - prefix + 1] = logits[0].float()  # (the copy waits for the step: the sync a sampler would make)
        stats.decode_step_s.append(time.perf_counter() - t0)
        stats.decode_tokens += 1
    stats.new_tokens = len(ids) - prefix
    return torch.log_softmax(out, dim=-1), stats
