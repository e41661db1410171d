"""The generation loop of `Engine.generate`: a batch of prompts through the scheduler — one packed prefill of all
of them, then batched decode steps until every sequence ends."""

from __future__ import annotations

from collections.abc import Callable

from moetier.engine.expert_executor import ExpertExecutor
from moetier.engine.grammar import Grammar
from moetier.engine.kv_pool import KVPool
from moetier.engine.request import RequestParams
from moetier.engine.sampling import SamplingParams
from moetier.engine.scheduler import OnStep, Scheduler, check_prompt
from moetier.engine.speculative import Speculation
from moetier.engine.stats import GenerationStats
from moetier.engine.tokenizer import Tokenizer
from moetier.errors import MoetierError
from moetier.model.kv_cache import KVCache
from moetier.model.transformer import Transformer

OnToken = Callable[[int, list[int]], None]  # (sequence index, its generated ids so far)
__all__ = ["OnStep", "OnToken", "check_prompts", "generate"]


def check_prompts(prompts: list[list[int]], context: int, vocab_size: int) -> None:
    if not prompts:
        raise MoetierError("no prompt given")
    for i, p in enumerate(prompts):
        check_prompt(p, context, vocab_size, name=f"prompt {i}")


def generate(model: Transformer, executor: ExpertExecutor, prompts: list[list[int]], params: SamplingParams,
             eos_ids: tuple[int, ...] = (), on_token: OnToken | None = None,
             stats: GenerationStats | None = None, step_hooks: list[OnStep] = (),
             grammar: Grammar | None = None, tokenizer: Tokenizer | None = None,
             speculation: Speculation | None = None,
             kv_cache: Callable[[int, int], KVCache] | None = None) -> tuple[list[list[int]], GenerationStats]:
    """Every prompt to its end (EOS, `params.max_new_tokens`, the context window, or `grammar` complete); one KV
    row each, prompt i sampled from its own generator seeded by `params.seed` + i (so it samples as it would alone
    with that seed). A grammar needs the model's `tokenizer`; `speculation`: decode steps that verify drafts;
    `kv_cache(rows, max_len)`: the KV cache to use (KeptCache; None: a new one)."""
    spec = model.spec
    check_prompts(prompts, spec.max_position_embeddings, spec.vocab_size)
    num = len(prompts)
    max_len = min(spec.max_position_embeddings, max(map(len, prompts)) + params.max_new_tokens)
    stats = stats or GenerationStats()
    stats.prompt_tokens = sum(map(len, prompts))
    cache = kv_cache(num, max_len) if kv_cache is not None else None
    scheduler = Scheduler(model, executor, KVPool(spec, num, max_len, model.dtype, model.device, cache), eos_ids,
                          tokenizer if grammar is not None else None, stats=stats, step_hooks=step_hooks,
                          speculation=speculation)
    ids = [scheduler.add_request(p, RequestParams(params, grammar=grammar), params.generator(i))  # (ids 0, 1, ...
           for i, p in enumerate(prompts)]
    outputs: list[list[int]] = [[] for _ in prompts]
    while scheduler.has_work:
        for out in scheduler.step():
            b = out.id - ids[0]
            outputs[b] = out.request.output
            if on_token is not None:
                on_token(b, out.request.output)
    stats.new_tokens = sum(map(len, outputs))
    return outputs, stats
