"""The OpenAI-compatible HTTP API over an `EngineLoop`: /v1/completions, /v1/chat/completions (SSE streaming ending
in `data: [DONE]`), /v1/models, /health, /metrics.

Every refusal is an OpenAI error body with a 4xx: the body is parsed and checked here (not by FastAPI's own
validation, whose 422 and body shape OpenAI clients do not expect) before anything reaches the engine."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from moetier.engine.chat_template import ChatTemplateError
from moetier.engine.grammar import Grammar
from moetier.engine.request import RequestParams, TokenLogprob
from moetier.engine.sampling import SamplingParams, check_vocab
from moetier.engine.scheduler import check_prompt
from moetier.errors import MoetierError, PromptTooLongError
from moetier.serve.engine_loop import EngineLoop, Event, Sink
from moetier.serve.guided import call_reader, output_grammar
from moetier.serve.idempotency import Abandoned, Idempotency
from moetier.serve.protocol import (
    MAX_SEED,
    ApiError,
    ChatRequest,
    CompletionRequest,
    Sampling,
    error_body,
    usage,
)

DISCONNECT_POLL_S = 0.5  # how often a waiting non-streaming handler checks that its client is still there
CLIENT_GONE = 499  # (nginx's "client closed request": the status of an answer nobody receives)


class ClientGone(Exception):
    """A non-streaming request's client went away before its answer was whole."""


@dataclass(frozen=True)
class ServeSettings:
    model_name: str
    max_model_len: int
    api_key: str | None = None
    max_queue: int = 64  # requests beyond the running ones; more: 429
    max_running: int = 4
    max_body_bytes: int = 4 << 20
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_queue < 0 or self.max_running < 1 or self.max_body_bytes < 1 or self.max_model_len < 2:
            raise MoetierError("serve settings out of range: max queue >= 0, max running >= 1, body limit >= 1, "
                               "max model length >= 2")


class Guard:
    """The API key (constant-time compare) and the body limit, before a handler reads anything — a plain ASGI
    middleware: FastAPI's `@app.middleware("http")` wraps each request's messages so that a handler never sees its
    client go away (`request.is_disconnected()` stayed False, and a whole answer whose client had left decoded on to
    its end)."""

    def __init__(self, app, settings: ServeSettings, loop: EngineLoop) -> None:
        self.app, self.settings, self.loop = app, settings, loop

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                return await refusal.response()(scope, receive, send)
        await self.app(scope, receive, send)

    def refusal(self, scope) -> ApiError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.settings.api_key is not None and scope["path"].startswith("/v1/"):
            expected = f"Bearer {self.settings.api_key}"
            if not hmac.compare_digest(headers.get("authorization", "").encode(), expected.encode()):
                return ApiError(401, "a wrong or missing API key", "authentication_error", "invalid_api_key")
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.settings.max_body_bytes):
            return ApiError(413, f"the request body is larger than {self.settings.max_body_bytes} bytes",
                            code="body_too_large")
        if self.loop.draining and scope["path"].startswith("/v1/") and scope["method"] == "POST":
            return ApiError(503, "the server is stopping: it finishes the requests it has and takes no more",
                            "service_unavailable", "draining",
                            headers={"Retry-After": str(self.settings.retry_after_s)})
        return None


def make_app(loop: EngineLoop, settings: ServeSettings) -> FastAPI:
    app = FastAPI(title="moetier", version="1", docs_url=None, redoc_url=None)
    app.add_middleware(Guard, settings=settings, loop=loop)
    tokenizer = loop.engine.tokenizer
    api = Api(loop, settings)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        if e.status != 429 and request.url.path.startswith("/v1/") and request.method == "POST":
            loop.metrics.requests.labels(outcome="invalid").inc()  # (429s are counted as rejected where made)
        return e.response()

    @app.exception_handler(404)
    async def not_found(request: Request, _) -> JSONResponse:
        return ApiError(404, f"no route {request.url.path}", code="not_found").response()

    @app.exception_handler(405)
    async def not_allowed(request: Request, _) -> JSONResponse:
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}").response()

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(loop.metrics.render(), media_type="text/plain; version=0.0.4")

    model_card = {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "moetier",
                  "max_model_len": settings.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != settings.model_name:
            raise ApiError(404, f"the model {model_id!r} does not exist here; this server runs "
                                f"{settings.model_name!r}", code="model_not_found", param="model")
        return model_card

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await api.parse(request, CompletionRequest)
        prompts = [api.tokens(p) for p in body.prompts()]
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens 0 generates nothing; it is for echo with logprobs", param="max_tokens")
        return await api.answer(request, body, prompts, CompletionFormat(tokenizer, body, prompts,
                                                                          settings.model_name))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await api.parse(request, ChatRequest)
        if tokenizer is None or tokenizer.chat_template is None:
            raise ApiError(400, f"{settings.model_name} has no chat template (tokenizer_config.json's "
                                f"chat_template or chat_template.jinja)", code="no_chat_template",
                           param="messages")
        template = tokenizer.chat_template
        reader = call_reader(body, template, settings.model_name)
        grammar = output_grammar(body, reader)
        tools = {"tools": [t.model_dump(exclude_none=True) for t in body.tools]} \
            if body.tools is not None and template.takes_tools else {}
        try:
            text = template.render([m.plain() for m in body.messages], **tools)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        if body.limit() == 0:  # (completions take it, with echo, for the prompt's logprobs; chat has no echo)
            raise ApiError(400, "max_tokens 0 generates nothing", param="max_completion_tokens"
                           if body.max_completion_tokens is not None else "max_tokens")
        prompt = tokenizer.encode(text, add_bos=False)
        return await api.answer(request, body, [prompt], ChatFormat(tokenizer, body, settings.model_name, reader),
                                grammar)

    return app


class Api:
    """What both endpoints do: parse, check, run, answer (whole or streamed)."""

    def __init__(self, loop: EngineLoop, settings: ServeSettings) -> None:
        self.loop, self.settings = loop, settings
        self.tokenizer = loop.engine.tokenizer
        self.spec = loop.engine.spec
        self.idempotency = Idempotency()

    async def parse(self, request: Request, kind: type[BaseModel]):
        raw = await request.body()
        if len(raw) > self.settings.max_body_bytes:  # (a body sent without a length)
            raise ApiError(413, f"the request body is larger than {self.settings.max_body_bytes} bytes",
                           code="body_too_large")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object")
        try:
            body = kind.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        if body.model is not None and body.model != self.settings.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist here; this server runs "
                                f"{self.settings.model_name!r}", code="model_not_found", param="model")
        return body

    def tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: give the prompt as token ids", param="prompt")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def params(self, body: Sampling, prompt: list[int], limit: int | None, logprobs: int | None,
               echo: bool, index: int, grammar: Grammar | None = None) -> RequestParams:
        room = self.settings.max_model_len - len(prompt)
        try:
            check_prompt(prompt, min(self.settings.max_model_len, self.spec.max_position_embeddings),
                         self.spec.vocab_size)
        except MoetierError as e:
            raise ApiError(400, str(e).split("\n")[0], param="prompt",
                           code="context_length_exceeded" if isinstance(e, PromptTooLongError) else None) from None
        if limit is not None and limit > room:
            raise ApiError(400, f"this model's maximum context length is {self.settings.max_model_len} tokens; the "
                                f"prompt has {len(prompt)} and max_tokens asks {limit} more",
                           code="context_length_exceeded", param="max_tokens")
        if body.stops() and self.tokenizer is None:
            raise ApiError(400, "stop strings need the model's tokenizer; this model has none", param="stop")
        seed = None if body.seed is None else (body.seed + index) % (MAX_SEED + 1)  # n > 1: each its own draws
        try:
            sampling = SamplingParams(max(1, limit if limit is not None else room), body.temperature, body.top_p,
                                      seed, top_k=max(0, body.top_k), min_p=body.min_p,
                                      repetition_penalty=body.repetition_penalty,
                                      presence_penalty=body.presence_penalty,
                                      frequency_penalty=body.frequency_penalty, logit_bias=body.bias())
            check_vocab(sampling, self.spec.vocab_size)
        except (MoetierError, ValueError) as e:
            raise ApiError(400, str(e).split("\n")[0], param="logit_bias" if "logit_bias" in str(e) else None) \
                from None
        return RequestParams(sampling, body.stops(), body.ignore_eos, logprobs, echo, grammar)

    async def answer(self, request: Request, body, prompts: list[list[int]], fmt, grammar: Grammar | None = None):
        if not prompts:
            raise ApiError(400, "no prompt given", param="prompt")
        chat = isinstance(body, ChatRequest)
        limit = body.limit() if chat else body.max_tokens
        logprobs = ((body.top_logprobs or 0) if body.logprobs else None) if chat else body.logprobs
        echo = (not chat) and body.echo and logprobs is not None
        jobs = [(prompt, self.params(body, prompt, limit, logprobs, echo, i, grammar))
                for prompt in prompts for i in range(body.n)]
        room = self.settings.max_running + self.settings.max_queue - self.loop.in_flight
        if len(jobs) > room:
            self.loop.metrics.requests.labels(outcome="rejected").inc()
            raise ApiError(429, "the server is busy: too many requests queued", "rate_limit_error",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        key = request.headers.get("idempotency-key")
        if key is None:
            return await self._run(request, body, jobs, fmt)
        fingerprint = hashlib.sha256(await request.body()).hexdigest()
        while (first := self.idempotency.claim(key, fingerprint, body.stream)) is not None:
            try:  # a retry: the first one's answer (or its refusal), once it has one
                return await asyncio.shield(first)
            except Abandoned:  # (its client went before it was whole: this one runs it)
                continue
        try:
            answer = await self._run(request, body, jobs, fmt)
        except BaseException as e:
            self.idempotency.fail(key, e)
            raise
        if isinstance(answer, dict):
            self.idempotency.settle(key, answer)
        elif not body.stream:  # (a client gone: nothing to give a retry, which runs it)
            self.idempotency.fail(key, ClientGone())
        return answer

    async def _run(self, request: Request, body, jobs: list, fmt):
        """Submit the jobs and answer: whole (a dict; a bare 499 if the client went), or a stream."""
        sinks = [Sink(asyncio.get_running_loop()) for _ in jobs]
        for (prompt, params), sink in zip(jobs, sinks):
            self.loop.submit(prompt, params, sink)
        if body.stream:  # released when the stream ends, and after the response whatever happened (a client gone
            # before the stream began never runs its generator's `finally`); the second time does nothing
            return StreamingResponse(self._stream(request, sinks, fmt), media_type="text/event-stream",
                                     background=BackgroundTask(self._release, sinks))
        try:
            events = [await self._collect(request, sink) for sink in sinks]
        except ClientGone:  # its requests aborted (below); what is answered goes nowhere
            return Response(status_code=CLIENT_GONE)
        finally:
            self._release(sinks)
        return fmt.whole(events, [p for p, _ in jobs])

    def _release(self, sinks: list[Sink]) -> None:
        """The requests are the handler's no more: aborted if still running, no longer counted (once)."""
        for sink in sinks:
            if not sink.released:
                sink.released = True
                self.loop.abort(sink)  # (nothing, if it finished)
                self.loop.finished()

    async def _collect(self, request: Request, sink: Sink) -> list[Event]:
        """The request's events, its client asked every DISCONNECT_POLL_S whether it is still there — also while
        tokens come faster than that (a client gone mid-answer left its request decoding to the end)."""
        events: list[Event] = []
        looked = time.monotonic()
        while not (events and events[-1].finished):
            try:
                item = await asyncio.wait_for(sink.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                item = None
            if time.monotonic() - looked >= DISCONNECT_POLL_S:
                looked = time.monotonic()
                if await request.is_disconnected():
                    raise ClientGone
            if item is not None:
                events.append(check_event(item))
        return events

    async def _stream(self, request: Request, sinks: list[Sink], fmt) -> AsyncIterator[str]:
        """Events of every choice as they come, then the usage and [DONE]. A client gone: the requests aborted."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, sink: Sink) -> None:
            while True:
                item = await sink.queue.get()
                await merged.put((index, item))
                if isinstance(item, BaseException) or item.finished:
                    return

        pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sinks)]
        try:
            for payload in fmt.first():
                yield sse(payload)
            done, last = 0, {}
            while done < len(sinks):
                index, item = await merged.get()
                if isinstance(item, BaseException):
                    yield sse(error_body(f"the engine failed: {item}", "server_error"))
                    return
                last[index] = item
                chunk = fmt.chunk(index, item)
                if chunk is not None:
                    yield sse(chunk)
                done += item.finished
            for payload in fmt.final(last):
                yield sse(payload)
            yield "data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            self._release(sinks)


def validation_error(e: ValidationError) -> ApiError:
    """A body's first fault as one 400: a field we do not honour named as such; a union's branch names left out
    of where it is (`prompt.0`, not `prompt.list[int].0`)."""
    errors = e.errors()
    unsupported = [err for err in errors if err["type"] == "extra_forbidden"]
    if unsupported:
        where = ".".join(str(p) for p in unsupported[0]["loc"])
        return ApiError(400, f"{where}: this server does not support this field (moetier honours every field it "
                             f"accepts, and refuses the rest)", code="unsupported_field", param=where)
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or ("[" not in p and p not in (
        "str", "int", "float", "bool", "list", "dict")))
    return ApiError(400, f"{where}: {first['msg']}", param=where or None)


def check_event(item: Event | BaseException) -> Event:
    if isinstance(item, MoetierError):
        raise ApiError(400, str(item).split("\n")[0])
    if isinstance(item, BaseException):
        raise ApiError(500, f"the engine failed: {item}", "server_error",  # (its part may have run: a client
                       headers={"x-should-retry": "false"})  # that retries 5xx, as openai's does, would run it again)
    return item


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class CompletionFormat:
    """/v1/completions' answers: text (the prompt's too with echo), legacy logprobs, usage."""

    def __init__(self, tokenizer, body: CompletionRequest, prompts: list[list[int]], model: str) -> None:
        self.tokenizer, self.body, self.model = tokenizer, body, model
        self.id, self.created = _id("cmpl"), int(time.time())
        self.n = body.n
        self.prompts = prompts
        self.skip_generated = body.max_tokens == 0  # echo only: the token generated to get the logits is dropped
        self.closed: set[int] = set()  # streamed choices whose finish reason went out with their last token

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode_token(token) if self.tokenizer is not None else str(token)

    def _head(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}

    def _top(self, e: TokenLogprob) -> dict:
        """The `logprobs` most likely tokens and the chosen one (OpenAI's "up to logprobs + 1 elements")."""
        top = {self._decode_one(t): lp for t, lp in e.top}
        top.setdefault(self._decode_one(e.token), e.logprob)
        return top

    def _logprobs(self, entries: list[TokenLogprob | None], offset: int) -> dict:
        tokens = [self._decode_one(e.token) if e is not None else None for e in entries]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t or "")
        return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else self._top(e) for e in entries],
                "text_offset": offsets}

    def whole(self, per_job: list[list[Event]], prompts: list[list[int]]) -> dict:
        choices, completion_tokens = [], 0
        for index, (events, prompt) in enumerate(zip(per_job, prompts)):
            r = events[-1].request
            text = "".join(e.text for e in events)
            entries: list = list(r.logprobs)
            if self.skip_generated:
                text, entries = "", []
            else:
                completion_tokens += len(r.output)
            prefix = ""
            if self.body.echo:
                prefix = self.tokenizer.decode(prompt) if self.tokenizer is not None else ""
                entries = list(r.prompt_logprobs or [None] * len(prompt)) + entries
            logprobs = self._logprobs(entries, 0) if self.body.logprobs is not None else None
            choices.append({"index": index, "text": prefix + text, "logprobs": logprobs,
                            "finish_reason": r.finish_reason})
        prompt_tokens = sum(len(p) for p in self.prompts)  # (each prompt once, however many choices)
        return {**self._head(choices), "usage": usage(prompt_tokens, completion_tokens)}

    def first(self) -> list[dict]:
        """With echo, each choice's prompt text (a chunk a choice, as every other); else nothing before the tokens."""
        if not (self.body.echo and self.tokenizer):
            return []
        return [self._head([{"index": i, "text": self.tokenizer.decode(p), "logprobs": None, "finish_reason": None}])
                for i, p in enumerate(p for p in self.prompts for _ in range(self.n))]

    def chunk(self, index: int, event: Event) -> dict | None:
        if event.token is None or self.skip_generated:
            return None
        logprobs = self._logprobs([event.logprob], 0) if event.logprob is not None else None
        if event.finished:
            self.closed.add(index)
        return self._head([{"index": index, "text": event.text, "logprobs": logprobs,
                            "finish_reason": event.finish_reason if event.finished else None}])

    def final(self, last: dict[int, Event]) -> list[dict]:
        """After the last token's chunks: the finish reason of each choice whose last chunk did not carry it (echo
        alone; an aborted one), and the usage, with no choices, where stream_options asks (as OpenAI's)."""
        open_ = [{"index": i, "text": "", "logprobs": None, "finish_reason": e.finish_reason}
                 for i, e in sorted(last.items()) if i not in self.closed]
        out = [self._head(open_)] if open_ else []
        if self.body.stream_usage:
            prompt_tokens = sum(len(p) for p in self.prompts)
            completion_tokens = 0 if self.skip_generated else sum(len(e.request.output) for e in last.values())
            out.append({**self._head([]), "usage": usage(prompt_tokens, completion_tokens)})
        return out


class ChatFormat:
    """/v1/chat/completions' answers: an assistant message (or its deltas), chat logprobs, usage. With tools, the
    calls are read from the text (`reader`, moetier/serve/tool_calls.py): a streamed answer sends its content as it
    comes up to where a call may begin, and its calls, whole, when the answer ends."""

    def __init__(self, tokenizer, body: ChatRequest, model: str, reader=None) -> None:
        self.tokenizer, self.body, self.model, self.reader = tokenizer, body, model, reader
        self.id, self.created = _id("chatcmpl"), int(time.time())
        self.texts: dict[int, str] = {}  # streamed, with a reader: each choice's text so far
        self.sent: dict[int, int] = {}  # how much of it went out as content
        self.reasons: dict[int, str] = {}  # a streamed choice's finish reason where its calls changed it
        self.closed: set[int] = set()  # streamed choices whose finish reason went out with their last token

    def _logprob(self, e: TokenLogprob) -> dict:
        def entry(token: int, lp: float) -> dict:
            text = self.tokenizer.decode_token(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}
        return {**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}

    def _head(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}

    def _message(self, text: str, reason: str) -> tuple[dict, str]:
        """The assistant's message for `text` and its finish reason (tool_calls where it called and stopped)."""
        parsed = self.reader.parse(text) if self.reader is not None else None
        if parsed is None or not parsed.calls:
            return {"role": "assistant", "content": text}, reason
        return ({"role": "assistant", "content": parsed.content, "tool_calls": [c.openai() for c in parsed.calls]},
                "tool_calls" if reason == "stop" else reason)

    def whole(self, per_job: list[list[Event]], prompts: list[list[int]]) -> dict:
        choices = []
        for index, events in enumerate(per_job):
            r = events[-1].request
            logprobs = {"content": [self._logprob(e) for e in r.logprobs]} if self.body.logprobs else None
            message, reason = self._message("".join(e.text for e in events), r.finish_reason)
            choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason})
        completion = sum(len(events[-1].request.output) for events in per_job)
        return {**self._head("chat.completion", choices), "usage": usage(len(prompts[0]), completion)}

    def first(self) -> list[dict]:
        """Each choice's role, in a chunk of its own (the role is said here alone)."""
        return [self._head("chat.completion.chunk", [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}])
                for i in range(self.body.n)]

    def chunk(self, index: int, event: Event) -> dict | None:
        if event.token is None:
            return None
        logprobs = ({"content": [self._logprob(event.logprob)]}
                    if self.body.logprobs and event.logprob is not None else None)
        delta = {"content": event.text} if self.reader is None else self._held_delta(index, event)
        reason = self.reasons.get(index, event.finish_reason) if event.finished else None
        if not delta and logprobs is None and reason is None:
            return None
        if reason is not None:
            self.closed.add(index)
        return self._head("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": logprobs,
                                                     "finish_reason": reason}])

    def _held_delta(self, index: int, event: Event) -> dict:
        """The content that can go out now: up to where a call may begin; at the end, the rest and the calls."""
        text = self.texts.get(index, "") + event.text
        self.texts[index], sent = text, self.sent.get(index, 0)
        if not event.finished:
            upto = max(sent, self.reader.held_from(text))
            self.sent[index] = upto
            return {"content": text[sent:upto]} if upto > sent else {}
        calls = self.reader.parse(text).calls
        if not calls:
            return {"content": text[sent:]} if len(text) > sent else {}
        if event.finish_reason == "stop":
            self.reasons[index] = "tool_calls"
        rest = self.reader.parse(text[sent:]).content
        return {**({"content": rest} if rest else {}), "tool_calls": [c.openai(i) for i, c in enumerate(calls)]}

    def final(self, last: dict[int, Event]) -> list[dict]:
        """As CompletionFormat.final: finish reasons not yet sent, then the usage chunk where asked."""
        open_ = [{"index": i, "delta": {}, "logprobs": None, "finish_reason": self.reasons.get(i, e.finish_reason)}
                 for i, e in sorted(last.items()) if i not in self.closed]
        out = [self._head("chat.completion.chunk", open_)] if open_ else []
        if self.body.stream_usage:
            prompt_tokens = len(next(iter(last.values())).request.prompt)
            completion = sum(len(e.request.output) for e in last.values())
            out.append({**self._head("chat.completion.chunk", []), "usage": usage(prompt_tokens, completion)})
        return out
