"""The generation loop: one packed prefill of all prompts, then batched decode steps until every sequence ends."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from moetier.engine.expert_executor import ExpertExecutor
from moetier.engine.sampling import SamplingParams, sample
from moetier.engine.stats import GenerationStats
from moetier.errors import MoetierError, PromptTooLongError
from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.model.transformer import Transformer
from moetier.plan.route import DECODE, PREFILL

OnToken = Callable[[int, list[int]], None]  # (sequence index, its generated ids so far)
OnStep = Callable[[StepBatch, int], None]  # (the step's tokens, PREFILL or DECODE), before the forward pass


def check_prompts(prompts: list[list[int]], context: int, vocab_size: int) -> None:
    if not prompts:
        raise MoetierError("no prompt given")
    for i, p in enumerate(prompts):
        if not p:
            raise MoetierError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise MoetierError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        if len(p) >= context:
            raise PromptTooLongError(f"prompt {i} has {len(p)} tokens; the model's context window is {context}",
                                     hint=f"shorten the prompt to at most {context - 1} tokens")


def generate(model: Transformer, executor: ExpertExecutor, prompts: list[list[int]], params: SamplingParams,
             eos_ids: tuple[int, ...] = (), on_token: OnToken | None = None,
             stats: GenerationStats | None = None,
             step_hooks: list[OnStep] = ()) -> tuple[list[list[int]], GenerationStats]:
    spec = model.spec
    check_prompts(prompts, spec.max_position_embeddings, spec.vocab_size)
    num = len(prompts)
    max_len = min(spec.max_position_embeddings, max(map(len, prompts)) + params.max_new_tokens)
    kv = KVCache(spec, num, max_len, model.dtype, model.device)
    stats = stats or GenerationStats()
    stats.prompt_tokens = sum(map(len, prompts))
    generator = torch.Generator().manual_seed(params.seed)
    eos = set(eos_ids)
    executor.layer_step.on_sequence_start()

    start = time.perf_counter()
    executor.begin_step(PREFILL, stats.phases)
    batch = StepBatch.prefill(prompts, list(range(num)), device=model.device)
    for hook in step_hooks:
        hook(batch, PREFILL)
    logits = model.forward(batch, kv)
    outputs = [[t] for t in sample(logits, params, generator)]
    stats.ttft_s = time.perf_counter() - start
    positions = [len(p) for p in prompts]  # where each sequence's newest token goes when it is fed back

    def finished(b: int) -> bool:
        out = outputs[b]
        if out[-1] in eos or len(out) >= params.max_new_tokens:
            return True
        if positions[b] >= max_len:  # only the context window ends it early (max_len is the smaller bound)
            stats.stopped_at_context.append(b)
            return True
        return False

    for b in range(num):
        if on_token is not None:
            on_token(b, outputs[b])
    active = [b for b in range(num) if not finished(b)]
    while active:
        t0 = time.perf_counter()
        executor.begin_step(DECODE, stats.phases)
        batch = StepBatch.decode_step([outputs[b][-1] for b in active], active, [positions[b] for b in active], num,
                                      device=model.device)
        for hook in step_hooks:
            hook(batch, DECODE)
        new = sample(model.forward(batch, kv), params, generator)
        stats.decode_step_s.append(time.perf_counter() - t0)
        stats.decode_tokens += len(active)
        for b, token in zip(active, new):
            outputs[b].append(token)
            positions[b] += 1
            if on_token is not None:
                on_token(b, outputs[b])
        active = [b for b in active if not finished(b)]
    stats.new_tokens = sum(map(len, outputs))
    return outputs, stats
