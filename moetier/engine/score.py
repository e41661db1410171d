"""Teacher-forced scoring in the engine: the next-token distributions a configuration computes for given texts,
fed as generation feeds them — a short prefill, then one decode step per token, the texts of a batch decoded
together — so every plan (which experts are read, at which precision, which are skipped or substituted) is the one
a user's decode at that batch size would get."""

from __future__ import annotations

import time

import torch

from moetier.engine.stats import GenerationStats
from moetier.errors import MoetierError
from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.plan.route import DECODE, PREFILL


def teacher_forced(engine, ids: list[int] | list[list[int]], prefix: int) -> tuple[torch.Tensor, GenerationStats]:
    """Log-probabilities (fp32) of the distribution each token from position `prefix` on was predicted from —
    [len - prefix, V] for one text, [B, len - prefix, V] for a batch of B texts of one length — and the run's
    statistics (decode step times, reads, hits)."""
    if engine.spec.encoder_decoder is not None:
        raise MoetierError("teacher-forced scoring feeds one text through a decoder; a text-to-text model reads its "
                           "input with an encoder and writes another text", hint="use a decoder-only model")
    batch = [list(row) for row in ids] if ids and isinstance(ids[0], list) else [list(ids)]
    n = len(batch[0])
    if any(len(row) != n for row in batch):
        raise ValueError("the texts of a batch must have one length")
    if not 0 < prefix < n:
        raise ValueError(f"prefix {prefix} must leave tokens to score in a window of {n}")
    model, executor, b = engine.model, engine.executor, len(batch)
    rows = list(range(b))
    kv = KVCache(model.spec, b, n, model.dtype, model.device)
    stats = GenerationStats(prompt_tokens=b * prefix)
    executor.layer_step.on_sequence_start()
    out = torch.empty(b, n - prefix, model.spec.vocab_size, dtype=torch.float32)
    executor.begin_step(PREFILL, stats.phases)
    out[:, 0] = model.forward(StepBatch.prefill([row[:prefix] for row in batch], rows, device=model.device),
                              kv).float()
    for j in range(prefix, n - 1):
        t0 = time.perf_counter()
        executor.begin_step(DECODE, stats.phases)
        step = StepBatch.decode_step([row[j] for row in batch], rows, [j] * b, b, device=model.device)
        out[:, j - prefix + 1] = model.forward(step, kv).float()  # (the copy waits for the step: a sampler's sync)
        stats.decode_step_s.append(time.perf_counter() - t0)
        stats.decode_tokens += b
    stats.new_tokens = b * (n - prefix)
    logp = torch.log_softmax(out, dim=-1)
    return (logp if isinstance(ids[0], list) else logp[0]), stats
