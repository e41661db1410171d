"""A decode step of up to ROWS sequences replayed as a CUDA graph where every expert is resident (`--cuda-graphs`).

Why: a GPU's decode step of an MoE model at batch 1 is bound by its host, not its GPU: the H200 run's profile
(bench/gpu/results/2026-11-27-h200, docs/gpu.md) counted ~1,700 kernel launches a token at 10-24 us each, and
with Triton's kernels a resident OLMoE step still launches ~300 — each launched by Python. A graph replays the
step's kernels in one launch, the host idle meanwhile.

What a graph needs, and how the step gives it:
- the same kernels on the same memory at every replay: the step's inputs (token ids, positions, KV rows) are copied
  into buffers the graph reads, and its outputs (the logits, each MoE layer's route) are the tensors captured,
  read after each replay;
- fixed shapes: decode attention runs over a fixed number of keys — a bucket: 256, then doubling, at most the KV
  cache's length, for the longest sequence — those past each token's position masked by its position on the device
  (gpt-fast's static cache does the same over the whole cache); one graph a number of sequences and a bucket,
  captured when a step first needs it;
- no read back to the host within the step: every expert resident and each token's experts computed from the
  router's ids on the device (`ResidentLayers.on_device`: TritonExperts' tables, each (token, expert) pair on its
  own: up to 8 tokens); each layer's route is told to the engine after the replay, in order (`heard`), as the CPU's
  one-call step tells them (moetier/model/resident_step.py);
- kernels that read the step's positions and rows from the device (`positions_on_device`: torch's ops and the GPU's
  Triton kernels; not the CPU's native ones, which take them from the host), and whose buffers kept across calls
  are never freed while a graph may write them (TritonExperts keeps the ones it outgrows: a prefill's larger
  `_h` must not free the memory a decode graph's replay writes).

The logits are the layer-by-layer step's up to the order of attention's sums (the masked keys add exact zeros).
Where not every expert is resident, each layer's routing is read back to plan its loads: the dense parts between
the layers' experts are graphs then (moetier/model/part_graphs.py), the same inputs and buckets. A step of more
sequences, or one of several tokens a sequence (a speculative verify), runs layer by layer as before. A capture that
fails (an op that reads back to the host, found only then) turns those graphs off for the engine, its reason kept
in `off` (the dense parts' in `parts.off`); the step runs layer by layer."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Protocol

import torch

from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.model.part_graphs import PartGraphs, failure
from moetier.model.rope import RopeTables

SHORTEST = 256  # keys of the shortest attention a graph runs over
ROWS = 8  # the most sequences a graphed step holds (TritonExperts.routed_tokens)


def bucket(length: int, max_len: int, shortest: int = SHORTEST) -> int:
    """Keys a graph's attention runs over for a sequence `length` tokens long (this step's token included)."""
    keys = shortest
    while keys < length:
        keys *= 2
    return min(keys, max_len)


Outputs = tuple[torch.Tensor, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]]  # logits, routes


class Replay(Protocol):
    def replay(self) -> None: ...


class CudaGraphCapture:
    """`capture(step, pool)` -> (graph, step's outputs): the step run once on a side stream first (Triton compiles
    and lazily made buffers are allocated outside the graph's memory, as torch's docs ask), then captured into
    `pool` (a memory pool shared with graphs replayed in the order captured; None: the graph's own). Errors of
    other threads' CUDA calls (the host tier's readers) are theirs: the capture is thread-local."""

    def __call__(self, step: Callable[[], Outputs], pool=None) -> tuple[Replay, Outputs]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            outputs = step()
        return graph, outputs


class Recorder:
    """The experts of a captured step: each layer's through the resident layers' `compute`, its route kept to be told
    after each replay."""

    def __init__(self, resident) -> None:
        self.resident, self.routes = resident, []

    def __call__(self, layer: int, x: torch.Tensor, scores: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, shared=None) -> torch.Tensor:
        self.routes.append((layer, scores, topk_ids, topk_weights))
        return self.resident.compute(layer, x, scores, topk_ids, topk_weights, shared)


class DecodeGraphs:
    def __init__(self, model, capture: Callable | None = None, shortest: int = SHORTEST) -> None:
        """`model`: a Transformer whose experts have `resident_on_device` and `heard`; `capture`: CudaGraphCapture
        (a test's stand-in replays the step eagerly); `shortest`: the shortest bucket's keys."""
        self.model, self.capture, self.shortest = model, capture or CudaGraphCapture(), shortest
        device = model.device
        self.token_ids, self.positions, self.rows = (torch.zeros(ROWS, dtype=torch.int64, device=device)
                                                     for _ in range(3))  # [ROWS] each: what the graphs read
        self.last = torch.arange(ROWS, device=device)  # [ROWS] each sequence's one token
        self.graphs: dict[tuple[int, int, bool], tuple[Replay, Outputs]] = {}  # (sequences, keys, all rows) ->
        # graph, outputs
        # where not every expert is resident: each layer's dense part a graph, the engine's experts between
        self.parts = PartGraphs(model, self.capture, (self.token_ids, self.positions, self.rows, self.last),
                                shortest)
        self.held: tuple = ()  # weak references to the KV cache and rope tables the graphs were captured on (a
        # finished call's KV cache is not kept for them)
        self.resident = None  # a weak reference to the resident layers the whole-step graphs were captured on
        self.captured = self.replayed = 0
        self.off: str | None = None  # why the whole-step graphs were turned off (a capture failed), or None

    @classmethod
    def make(cls, model, capture=None, shortest: int = SHORTEST) -> DecodeGraphs | None:
        """Graphs for `model`, or None where its step cannot be replayed: kernels that take positions from the host,
        or experts that cannot say whether they are resident."""
        if not getattr(model.kernels, "positions_on_device", False) or not hasattr(model.experts,
                                                                                   "resident_on_device"):
            return None
        return cls(model, capture, shortest)

    def close(self) -> None:
        """Every graph dropped (their memory pools back to torch's allocator); none is captured again."""
        self.graphs.clear()
        self.parts.clear()
        self.held, self.resident = (), None
        self.off = self.off or "closed"
        self.parts.off = self.parts.off or "closed"

    @property
    def status(self) -> dict:
        return {"captured": self.captured, "replayed": self.replayed, "off": self.off, "parts": self.parts.status}

    @property
    def note(self) -> str:
        """What the graphs did, for a line on stderr."""
        failed = [f"{what} ({off})" for what, off in (("the whole step's", self.off), ("the dense parts'",
                                                                                       self.parts.off))
                  if off not in (None, "closed")]
        done = []
        if self.replayed:
            done.append(f"{self.replayed} decode steps replayed from {self.captured} captured")
        if self.parts.replayed:
            done.append(f"{self.parts.replayed} steps' dense parts replayed from {self.parts.captured} captured "
                        "chains")
        if not done and not failed:
            return ("CUDA graphs: no step replayed (they need at most 8 sequences, one token each, and Triton's "
                    "kernels: docs/gpu.md#cuda-graphs)")
        line = "CUDA graphs: " + ("; ".join(done) if done else "no step replayed")
        if failed:
            line += "; turned off, a capture failed: " + ", ".join(failed) + " (those steps ran layer by layer)"
        return line

    def __call__(self, batch: StepBatch, kv: KVCache, rope: RopeTables) -> torch.Tensor | None:
        """The step's logits [B, V] from graphs' replays, its routes told to the engine (or its experts run by the
        engine between the dense parts'); None where no graph applies (the caller runs the step layer by layer)."""
        b = len(batch.rows_host)
        if b > ROWS or batch.num_tokens != b or (self.off and self.parts.off):  # (a verify step's several tokens
            return None  # a row)
        held = (kv, rope)
        if len(self.held) != 2 or any(ref() is not now for ref, now in zip(self.held, held)):
            self.graphs.clear()  # (a new cache or tables: every graph read the old ones)
            self.parts.clear()
            self.held = tuple(weakref.ref(now) for now in held)
        self.token_ids[:b].copy_(batch.token_ids)
        self.positions[:b].copy_(batch.positions)
        self.rows[:b].copy_(batch.rows)
        key = (b, bucket(max(batch.lengths_host), kv.max_len, self.shortest), batch.all_rows)
        resident = self.model.experts.resident_on_device(b)
        if resident is None:  # (a layer's experts planned on the host: its routing read back)
            return self.parts(key, batch.rows_host, kv, rope)
        return self._replay(key, batch.rows_host, kv, rope, resident)

    def _replay(self, key: tuple[int, int, bool], rows_host: list[int], kv: KVCache, rope: RopeTables,
                resident) -> torch.Tensor | None:
        """The whole step from one graph, every expert resident."""
        if self.off is not None:
            return None
        if self.resident is None or self.resident() is not resident:
            self.graphs.clear()  # (the slots or tables changed: every graph read the old ones)
            self.resident = weakref.ref(resident)
        entry = self.graphs.get(key) or self._capture(key, rows_host, kv, rope, resident)
        if entry is None:
            return None
        graph, (logits, routes) = entry
        graph.replay()
        self.replayed += 1
        experts = self.model.experts
        for layer, scores, topk_ids, topk_weights in routes:
            experts.heard(layer, scores, topk_ids, topk_weights)
        return logits.clone()  # (the captured one is written again by the next replay)

    def _capture(self, key: tuple[int, int, bool], rows_host: list[int], kv: KVCache, rope: RopeTables,
                 resident) -> tuple[Replay, Outputs] | None:
        b, keys, all_rows = key

        def step() -> Outputs:
            # the graphs' step: its host fields say the attention's fixed length, never a token's own position;
            # made afresh each call, so the mask it makes from the positions is made inside the capture, not kept
            # from the warm-up before it (a constant in the graph)
            batch = StepBatch(self.token_ids[:b], self.positions[:b], self.rows[:b], self.last[:b], True,
                              rows_host=list(rows_host), lengths_host=[keys] * b, all_rows=all_rows)
            recorder = Recorder(resident)
            logits = self.model.run_layers(batch, kv, rope, recorder)
            return logits, recorder.routes

        try:
            entry = self.capture(step, None)
        except Exception as e:  # noqa: BLE001 - any op that cannot be captured: the step runs layer by layer
            self.off = failure(e)
            self.graphs.clear()
            return None
        self.graphs[key] = entry
        self.captured += 1
        return entry
