"""`moetier serve --ray`: the same OpenAI endpoints over N replicas of the engine, each with its own expert cache
and KV rows, on one machine or a Ray cluster — by Ray Serve (the optional `moetier[ray]` extra).

An ingress deployment takes the HTTP requests and hands each to an engine replica through a deployment handle; the
replica runs it through moetier's own app (moetier/serve/app.py: every check, refusal and answer as a single server
gives them), in process. Which replica takes a request is Ray Serve's prefix-aware router
(`PrefixCacheAffinityRouter`): it keeps a tree of the prompts each replica has served, and while the replicas' queues
are near even it sends a request to the one that served the longest prefix of its text — a conversation returns to
the replica holding its hot experts (and, were its KV rows kept, its prefix) — else to the less loaded of two.

A replica that dies (its process killed, its machine gone) fails the requests it was running with a clean error — a
503 with OpenAI's error body, or, in a stream already begun, an error event and the end of the stream — and Ray
Serve restarts it; the others keep serving."""

import json  # (no `from __future__ import annotations`: FastAPI reads the ingress's parameter types at run time)
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig

from moetier.serve.protocol import error_body

REPLICA_HEADER = "x-moetier-replica"  # on every answer: the Ray actor of the replica that gave it

# Ray Serve's prefix-aware router (exported as ray.serve.llm.request_router.PrefixCacheAffinityRouter, whose package
# also loads Ray's LLM stack and pyarrow; the class itself needs neither)
ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"


@dataclass
class Forwarded:
    """A request as it came (method, path, headers, body), for a replica's app to answer."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    stream: bool = False


@dataclass
class ForwardedChat(Forwarded):
    messages: list = field(default_factory=list)  # (what the prefix router reads)


@dataclass
class ForwardedCompletion(Forwarded):
    prompt: object = ""  # (what the prefix router reads)


def _has_text(value) -> bool:
    """Whether the router finds text in `value`: a string, strings, or messages whose content (or text parts) say
    something. Token ids it reads as no text — and it divides by the text's length."""
    if isinstance(value, str):
        return bool(value)
    if isinstance(value, list):
        return any(_has_text(v) for v in value)
    if isinstance(value, dict):
        return _has_text(value.get("text")) or _has_text(value.get("content"))
    return False


def forwarded(method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> Forwarded:
    """The request with the text the prefix router matches on: a chat's messages, a completion's prompt (a request
    without text — token ids, a GET — is routed on its path)."""
    try:
        data = json.loads(body) if body else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = {}  # (the replica's app answers it: a 400)
    data = data if isinstance(data, dict) else {}
    stream = data.get("stream") is True
    if path == "/v1/chat/completions" and isinstance(data.get("messages"), list) and _has_text(data["messages"]):
        return ForwardedChat(method, path, headers, body, stream, data["messages"])
    if path == "/v1/completions" and _has_text(data.get("prompt")):
        return ForwardedCompletion(method, path, headers, body, stream, data["prompt"])
    return ForwardedCompletion(method, path, headers, body, stream, path)


class EngineReplica:
    """One engine, its loop and moetier's app, answering forwarded requests in process."""

    def __init__(self, model: str, engine_options: dict, serve_options: dict, max_prefill_tokens: int | None = None
                 ) -> None:
        import httpx
        import ray

        from moetier.engine.engine import Engine
        from moetier.serve.app import ServeSettings, make_app
        from moetier.serve.engine_loop import EngineLoop
        from moetier.serve.metrics import Metrics

        settings = ServeSettings(**serve_options)
        self.engine = Engine.from_pretrained(model, progress=False, **engine_options)
        self.loop = EngineLoop(self.engine, settings.max_running, settings.max_model_len, max_prefill_tokens,
                               Metrics())
        self.loop.start()
        self.app = make_app(self.loop, settings)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://replica",
                                        timeout=None)
        # (Ray's name for this replica's actor, as `ray list actors` shows it: for a user's logs when one misbehaves)
        self.named = (REPLICA_HEADER, ray.get_runtime_context().get_actor_name() or "")

    async def whole(self, request: Forwarded) -> tuple[int, list[tuple[str, str]], bytes]:
        r = await self.client.request(request.method, request.path, headers=request.headers, content=request.body)
        return r.status_code, [*r.headers.items(), self.named], r.content

    async def stream(self, request: Forwarded):
        """(status, headers) first, then the body's chunks as the app sends them (httpx's ASGI transport would hold
        them to the end: the app is called directly)."""
        import asyncio

        sent: asyncio.Queue = asyncio.Queue()
        given = False

        async def receive() -> dict:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await asyncio.Event().wait()  # (then nothing more: a disconnect is never sent)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
                 "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "query_string": b"",
                 "root_path": "", "headers": [(k.lower().encode(), v.encode()) for k, v in request.headers],
                 "client": ("ray", 0), "server": ("replica", 80)}
        task = asyncio.create_task(self.app(scope, receive, sent.put))
        try:
            while True:
                message = await sent.get()
                if message["type"] == "http.response.start":
                    yield message["status"], [*((k.decode(), v.decode()) for k, v in message["headers"]), self.named]
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
        finally:
            task.cancel()


def replica_gone(e: BaseException) -> bytes:
    return json.dumps(error_body(f"the replica serving this request stopped ({type(e).__name__}); the others go "
                                 f"on: send it again", "service_unavailable", "replica_gone")).encode()


app = FastAPI(title="moetier (Ray Serve)", docs_url=None, redoc_url=None)


@serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Ingress:
    """Takes the HTTP requests and hands each to an engine replica (the prefix-aware router picks which)."""

    def __init__(self, engines) -> None:
        self.engines = engines

    @app.api_route("/{path:path}", methods=["GET", "HEAD", "POST"])
    async def forward(self, request: Request, path: str):
        sent = forwarded(request.method, "/" + path, [(k, v) for k, v in request.headers.items()
                                                    if k.lower() not in ("host", "content-length")],
                         await request.body())
        if not sent.stream:
            try:
                status, headers, body = await self.engines.whole.remote(sent)
            except Exception as e:  # (a replica gone, or Ray's own failure: never a bare 500)
                return Response(replica_gone(e), 503, media_type="application/json")
            kept = {k: v for k, v in headers if k.lower() not in ("content-length", "content-encoding")}
            return Response(body, status, headers=kept)
        chunks = self.engines.options(stream=True).stream.remote(sent)
        try:
            status, headers = await chunks.__anext__()
        except Exception as e:
            return Response(replica_gone(e), 503, media_type="application/json")

        async def body():
            try:
                async for chunk in chunks:
                    yield chunk
            except Exception as e:  # mid-stream: an error event, then the stream's end
                yield b"data: " + replica_gone(e) + b"\n\ndata: [DONE]\n\n"

        kept = {k: v for k, v in headers if k.lower() not in ("content-length", "transfer-encoding")}
        return StreamingResponse(body(), status, headers=kept, media_type="text/event-stream")


def build(model: str, replicas: int, engine_options: dict, serve_options: dict, max_prefill_tokens: int | None = None,
          cpus_per_replica: float = 1.0):
    """The Ray Serve application: the ingress and `replicas` engine replicas behind the prefix-aware router."""
    engines = serve.deployment(EngineReplica, name="engine", num_replicas=replicas,
                               ray_actor_options={"num_cpus": cpus_per_replica},
                               request_router_config=RequestRouterConfig(request_router_class=ROUTER))
    return Ingress.bind(engines.bind(model, engine_options, serve_options, max_prefill_tokens))
