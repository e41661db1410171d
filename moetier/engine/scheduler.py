"""The engine's core, nano-vllm style: requests join and leave between forward steps (continuous batching).

    id = scheduler.add_request(prompt_ids, params)     queued; checked now (empty, vocabulary, length)
    outputs = scheduler.step()                          one forward step: [StepOutput(request, token, finished)]
    scheduler.abort(id)                                 gone before the next step, its KV row free again

A step is either a prefill or a decode. Newcomers go first: while requests wait and KV rows are free, a step packs
their prompts (up to `max_prefill_tokens`) into one prefill of their own rows; otherwise every running request
decodes one token together. A prefill never shares a step with decode tokens (no chunked prefill): the running
requests wait one prefill, which is simple and keeps each step one of the two shapes the model and the planner
know; a request asking for its prompt's log-probabilities runs its prefill alone, with every position's logits.

A step's requests are sampled together, each with its own parameters and its own generator (moetier/engine/
sampling.py), so a request's tokens do not depend on who else runs."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

import torch

from moetier.engine.decoding import PlainDecode, SpeculativeDecode
from moetier.engine.expert_executor import ExpertExecutor
from moetier.engine.grammar import Matcher
from moetier.engine.kv_pool import KVPool
from moetier.engine.request import (
    ABORT,
    FINISHED,
    LENGTH,
    RUNNING,
    STOP,
    WAITING,
    Request,
    RequestParams,
    StepOutput,
    TokenLogprob,
)
from moetier.engine.sampling import check_vocab, sample
from moetier.engine.speculative import Speculation
from moetier.engine.stats import GenerationStats
from moetier.engine.text_output import TextOutput
from moetier.engine.tokenizer import Tokenizer
from moetier.errors import MoetierError, PromptTooLongError
from moetier.model.batch import StepBatch
from moetier.model.transformer import Transformer
from moetier.plan.route import PREFILL

OnStep = Callable[[StepBatch, int], None]  # (the step's tokens, PREFILL or DECODE), before the forward pass


def check_prompt(prompt: list[int], context: int, vocab_size: int, name: str = "the prompt",
                 limit: str = "the model's context window") -> None:
    if not prompt:
        raise MoetierError(f"{name} is empty")
    bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise MoetierError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(prompt) >= context:
        raise PromptTooLongError(f"{name} has {len(prompt)} tokens; {limit} is {context}",
                                 hint=f"shorten the prompt to at most {context - 1} tokens")


class Scheduler:
    def __init__(self, model: Transformer, executor: ExpertExecutor, kv: KVPool, eos_ids: Iterable[int] = (),
                 tokenizer: Tokenizer | None = None, max_running: int | None = None,
                 max_prefill_tokens: int | None = None, stats: GenerationStats | None = None,
                 step_hooks: Iterable[OnStep] = (), speculation: Speculation | None = None) -> None:
        """`max_running`: requests decoded together (default: the KV rows); `max_prefill_tokens`: prompt tokens one
        prefill step packs (a longer prompt still runs, alone; None: no bound); `stats`: where steps are counted
        (DESIGN.md's measures; `ttft_s` is the first prefill's); `speculation`: decode steps that verify drafted
        tokens (moetier/engine/speculative.py), else one token a request a step."""
        self.model, self.executor, self.kv = model, executor, kv
        self.eos = frozenset(eos_ids)
        self.tokenizer = tokenizer
        self.max_running = kv.rows if max_running is None else min(max_running, kv.rows)
        if self.max_running < 1:
            raise MoetierError(f"max running must be at least 1, got {max_running}")
        self.max_prefill_tokens = max_prefill_tokens
        self.stats = stats if stats is not None else GenerationStats()
        self.step_hooks = list(step_hooks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}  # waiting or running
        self._next_id = 0
        self._aborted: list[Request] = []  # since the last step: reported by it
        self.decoder = SpeculativeDecode(speculation) if speculation is not None else PlainDecode()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    def add_request(self, prompt: list[int], params: RequestParams | None = None,
                    generator: torch.Generator | None = None) -> int:
        """Queue a request (refused now if its prompt cannot run); `generator`: the one it draws from (default: its
        own, seeded by its seed, or fresh where it has none)."""
        spec, params = self.model.spec, params or RequestParams()
        limit = ("the model's context window" if self.kv.max_len >= spec.max_position_embeddings
                 else "the server's longest sequence (--max-model-len)")
        check_prompt(prompt, min(self.kv.max_len, spec.max_position_embeddings), spec.vocab_size, limit=limit)
        if params.stop and self.tokenizer is None:
            raise MoetierError("stop strings need the model's tokenizer; this model has none",
                               hint="stop on token ids instead (EOS), or give max_tokens")
        if params.echo_logprobs and spec.encoder_decoder is not None:
            raise MoetierError("a text-to-text model gives no log-probabilities of its prompt tokens")
        check_vocab(params.sampling, spec.vocab_size)
        generator = generator or params.sampling.generator()
        request = Request(self._next_id, list(prompt), params, generator)
        if params.grammar is not None:
            if self.tokenizer is None:
                raise MoetierError("holding output to a grammar needs the model's tokenizer; this model has none")
            request.matcher = Matcher(params.grammar, self.tokenizer.grammar_vocabulary(spec.vocab_size, self.eos))
        if self.tokenizer is not None:
            request.text = TextOutput(self.tokenizer, params.stop)
        self._next_id += 1
        self.requests[request.id] = request
        self.waiting.append(request)
        return request.id

    def abort(self, request_id: int) -> bool:
        """End a waiting or running request now (its KV row freed); False if it is not here (finished already)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request.status == WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
            self.kv.give(request.row)
        request.status, request.finish_reason = FINISHED, ABORT
        self._aborted.append(request)
        return True

    def step(self, admit: bool = True) -> list[StepOutput]:
        """One forward step (a prefill of newcomers, else a decode of every running request) and what it made,
        aborted requests first. Nothing to do: []. `admit` False: no newcomer starts (the running ones drain)."""
        outputs = [StepOutput(r, None, True) for r in self._aborted]
        self._aborted.clear()
        newcomers = self._admit() if admit else []
        if newcomers:
            return outputs + self._prefill(newcomers)
        if self.running:
            return outputs + self._decode()
        return outputs

    def use(self, model: Transformer, executor: ExpertExecutor) -> None:
        """Run `model` and `executor` from the next step on (a variant of the same model: Engine.use_variant). Only
        when nothing is running: a request's KV rows and routing belong to the model that began it."""
        if self.running:
            raise MoetierError("a variant is switched to only when no request is running")
        self.model, self.executor = model, executor

    def _admit(self) -> list[Request]:
        """Waiting requests a prefill step takes now, in arrival order."""
        chosen: list[Request] = []
        tokens = 0
        while self.waiting and self.kv.free > len(chosen) and len(self.running) + len(chosen) < self.max_running:
            head = self.waiting[0]
            alone = head.params.echo_logprobs or (chosen and chosen[0].params.echo_logprobs)
            over = self.max_prefill_tokens is not None and tokens + len(head.prompt) > self.max_prefill_tokens
            if chosen and (alone or over):
                break
            chosen.append(self.waiting.popleft())
            tokens += len(head.prompt)
        return chosen

    def begin(self, phase: int, batch: StepBatch) -> None:
        if not self.running and phase == PREFILL:  # the engine starts from idle: policy and predictor reset
            self.executor.layer_step.on_sequence_start()
        self.executor.begin_step(phase, self.stats.phases)
        for hook in self.step_hooks:
            hook(batch, phase)

    def _prefill(self, requests: list[Request]) -> list[StepOutput]:
        start = time.perf_counter()
        for r in requests:
            r.row, r.status = self.kv.take(), RUNNING
        batch = StepBatch.prefill([r.prompt for r in requests], [r.row for r in requests], device=self.model.device)
        self.begin(PREFILL, batch)
        self.running += requests
        echo = requests[0].params.echo_logprobs  # (then it is alone)
        logits = self.model.forward(batch, self.kv.cache, all_logits=echo)  # [B, V] or [N, V]
        if echo:
            requests[0].prompt_logprobs = prompt_logprobs(logits, requests[0].prompt, requests[0].params.logprobs)
            logits = logits[batch.last]
        outputs = self.sampled(requests, logits)
        if not self.stats.ttft_s:
            self.stats.ttft_s = time.perf_counter() - start
        return outputs

    def _decode(self) -> list[StepOutput]:
        return self.decoder.step(self)

    def sampled(self, requests: list[Request], logits: torch.Tensor) -> list[StepOutput]:
        """Each request's next token from its row of `logits` [B, V], appended, and the requests that end here
        leave (their rows free)."""
        tokens = self._sample(requests, logits)
        outputs = [self.append(r, token, logits[i]) for i, (r, token) in enumerate(zip(requests, tokens))]
        self.leave_finished()
        return outputs

    def append(self, r: Request, token: int, logits: torch.Tensor) -> StepOutput:
        """`token` (drawn from `logits` [V], its position's) appended to `r`'s output, and whether it ends `r`."""
        logprob = None
        if r.params.logprobs is not None:
            logprob = token_logprob(logits, token, r.params.logprobs)
            r.logprobs.append(logprob)
        r.output.append(token)
        if r.matcher is not None:
            r.matcher.accept(token)
        r.position = len(r.prompt) + len(r.output) - 1
        self._check_finished(r, token)
        return StepOutput(r, token, r.finished, logprob)

    def leave_finished(self) -> None:
        """The requests that ended leave the running set (their rows were given back as they ended)."""
        if any(r.finished for r in self.running):
            self.running = [r for r in self.running if not r.finished]

    def _sample(self, requests: list[Request], logits: torch.Tensor) -> list[int]:
        """Each request's token from its row, by its own parameters and generator (one call for the batch)."""
        params = [r.params.sampling for r in requests]
        shaped = any(p.shaped for p in params)  # (the penalties' context lists only where one looks at them)
        held = [(i, r.matcher) for i, r in enumerate(requests) if r.matcher is not None]
        if held:  # a copy: log-probabilities stay the model's own (as OpenAI's and vLLM's are)
            logits = logits.clone()
            for i, matcher in held:
                matcher.mask_(logits[i])
        return sample(logits, params, [r.generator for r in requests],
                      [r.prompt + r.output for r in requests] if shaped else None,
                      [r.output for r in requests] if shaped else None)

    def _check_finished(self, r: Request, token: int) -> None:
        """EOS, a stop string, max tokens, or the end of its KV row. Its text (where it has one) is brought up to
        date here, once a token, and whole at the end."""
        reason = None
        if token in self.eos and not r.params.ignore_eos:
            reason = STOP
        elif r.text is not None and r.text.update(r.output):  # (True only at a stop string)
            reason = STOP
        elif r.matcher is not None and r.matcher.done:  # the grammar is complete
            reason = STOP
        elif len(r.output) >= r.params.sampling.max_new_tokens:
            reason = LENGTH
        elif r.position >= self.kv.max_len:
            reason, r.stopped_at_context = LENGTH, True
            self.stats.stopped_at_context.append(r.id)
        if reason is not None:
            if r.text is not None and not r.text.stopped:  # an incomplete character at the end stays
                r.text.update(r.output, final=True)
            r.status, r.finish_reason = FINISHED, reason
            self.kv.give(r.row)
            del self.requests[r.id]


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """logits [V] -> the token's log-softmax and the `top` best (a host sync: a few floats)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logp, top) if top else None
    alternatives = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprob(token, float(logp[token]), alternatives)


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], top: int | None) -> list[TokenLogprob | None]:
    """Every prompt token's log-probability given the tokens before it, from the prefill's logits [N, V] (the first
    token has no context: None)."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)  # [N-1, V]: position i predicts token i+1
    targets = torch.tensor(prompt[1:], device=logits.device)
    chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
    best = torch.topk(logp, top) if top else None
    out: list[TokenLogprob | None] = [None]
    for i, (token, value) in enumerate(zip(prompt[1:], chosen)):
        alternatives = tuple(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else ()
        out.append(TokenLogprob(token, value, alternatives))
    return out

