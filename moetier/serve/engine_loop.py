"""The engine on a thread of its own: it steps the scheduler while there is work and sleeps when there is none.
The server's handlers (on the event loop) hand it requests and aborts through a queue, and each request's events
come back on an asyncio queue of its own (`Sink`), so no handler ever waits on the engine."""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from dataclasses import dataclass

from moetier.engine.engine import Engine
from moetier.engine.kv_pool import KVPool
from moetier.engine.request import Request, RequestParams, TokenLogprob
from moetier.engine.scheduler import Scheduler
from moetier.engine.stats import GenerationStats
from moetier.serve.metrics import Metrics


@dataclass(frozen=True)
class Event:
    """What a request got in one step: a token (None once aborted), the text it completed (held back while a stop
    string could still begin), and whether it ended."""

    token: int | None
    text: str
    finished: bool
    finish_reason: str | None
    logprob: TokenLogprob | None
    request: Request


class Sink:
    """Where one request's events arrive, on the event loop that made it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        self.arrived = time.perf_counter()
        self.last_token: float | None = None  # when its previous token came (inter-token latency)
        self.released = False  # the handler is done with it (the event loop's flag)

    def put(self, item: Event | BaseException) -> None:  # (from the engine's thread)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineLoop:
    def __init__(self, engine: Engine, max_running: int, max_model_len: int, max_prefill_tokens: int | None,
                 metrics: Metrics, gather_s: float = 0.01) -> None:
        """`gather_s`: how long the engine, woken from idle by a request, waits for others arriving with it, so
        that a burst shares one prefill (under a small expert budget a prefill reads most of the model's experts:
        one a request costs that read again for each)."""
        spec, model = engine.spec, engine.model
        self.gather_s = gather_s
        self.engine, self.metrics = engine, metrics
        self.kv = KVPool(spec, max_running, max_model_len, model.dtype, model.device)
        self.stats = GenerationStats()
        self.scheduler = Scheduler(model, engine.executor, self.kv, spec.eos_token_ids, engine.tokenizer, max_running,
                                   max_prefill_tokens, self.stats, engine.step_hooks, engine.config.speculation)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._sinks: dict[int, Sink] = {}  # request id -> its sink (the engine thread's own)
        self._ids: dict[int, int] = {}  # id(sink) -> request id, for aborts
        self.in_flight = 0  # requests submitted and not finished (the event loop's count)
        self.draining = False  # the server is stopping: the requests in flight finish, new ones get a 503
        self._thread = threading.Thread(target=self._run, name="moetier-engine", daemon=True)
        self._counted = (0, 0, 0)  # (needed, hits, bytes read) reported to the metrics so far

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finish the step in progress and end the thread (requests still queued are dropped)."""
        self._stopping = True
        self._wake.set()
        self._thread.join()

    def submit(self, prompt: list[int], params: RequestParams, sink: Sink) -> None:
        self.in_flight += 1
        self._commands.put(("add", prompt, params, sink))
        self._wake.set()

    def abort(self, sink: Sink) -> None:
        self._commands.put(("abort", sink))
        self._wake.set()

    def finished(self) -> None:
        """A handler is done with its request (answered, refused or gone)."""
        self.in_flight -= 1

    # -- the engine's thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            self._drain()
            if not self.scheduler.has_work:
                self._wake.wait()
                time.sleep(self.gather_s)  # (woken from idle: a burst's other requests arrive now)
                continue
            switching = self._switch_due()
            if switching and not self.scheduler.running:
                self._switch()
                switching = False
            try:
                outputs = self.scheduler.step(admit=not switching)
            except Exception as e:  # a failed read, a bug: every request in the engine ends with it
                print(f"moetier: error: a step failed: {e}", file=sys.stderr)
                self._fail_all(e)
                continue
            now = time.perf_counter()
            for out in outputs:
                self._deliver(out.request, out.token, out.logprob, now)
            self.stats.decode_step_s.clear()  # (the server keeps histograms, not every step's time)
            self._observe()

    def _switch_due(self) -> bool:
        """A switch of variant asked for (`--adapt --variants`: moetier/engine/adapt_variant.py): the running
        requests finish on the variant they began on, newcomers wait, and the switch is made between them."""
        adapt = self.engine.adapt_variant
        return adapt is not None and adapt.pending is not None

    def _switch(self) -> None:
        before = self.engine.store
        self.engine.adapt_variant.apply()  # (says what it did; a refused switch leaves the engine as it was)
        if self.engine.store is not before:
            self.scheduler.use(self.engine.model, self.engine.executor)
            self.metrics.variant_switches.inc()

    def _drain(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, prompt, params, sink = command
                try:
                    rid = self.scheduler.add_request(prompt, params)
                except Exception as e:  # (the handler checked it; a refusal here is still the request's answer)
                    sink.put(e)
                    continue
                self._sinks[rid], self._ids[id(sink)] = sink, rid
            else:
                rid = self._ids.get(id(command[1]))
                if rid is not None:
                    self.scheduler.abort(rid)

    def _deliver(self, r: Request, token: int | None, logprob: TokenLogprob | None, now: float) -> None:
        sink = self._sinks.get(r.id)
        if sink is None:
            return
        # (the scheduler brought the text up to date: here only the part not sent yet)
        text = r.text.delta(final=r.finished) if r.text is not None and token is not None else ""
        if token is not None:
            if sink.last_token is None:
                self.metrics.ttft.observe(now - sink.arrived)
            else:
                self.metrics.inter_token.observe(now - sink.last_token)
            sink.last_token = now
            self.metrics.generation_tokens.inc()
        sink.put(Event(token, text, r.finished, r.finish_reason, logprob, r))
        if r.finished:
            self.metrics.requests.labels(outcome=r.finish_reason).inc()
            self.metrics.prompt_tokens.inc(len(r.prompt))
            del self._sinks[r.id], self._ids[id(sink)]

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self.scheduler.requests):
            self.scheduler.abort(rid)
        for out in self.scheduler.step():  # (only the aborts: nothing is left to run)
            sink = self._sinks.pop(out.id, None)
            if sink is not None:
                self._ids.pop(id(sink), None)
                self.metrics.requests.labels(outcome="error").inc()
                sink.put(error)

    def _observe(self) -> None:
        """The gauges and the expert counters, after a step."""
        m, s = self.metrics, self.scheduler
        m.waiting.set(len(s.waiting))
        m.running.set(len(s.running))
        pre, dec = self.stats.phases
        needed, hits, read = pre.needed + dec.needed, pre.hits + dec.hits, pre.bytes_read + dec.bytes_read
        m.expert_needed.inc(needed - self._counted[0])
        m.expert_hits.inc(hits - self._counted[1])
        m.expert_bytes_read.inc(read - self._counted[2])
        self._counted = (needed, hits, read)
