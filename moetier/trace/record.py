"""Records routing from moetier's own engine: every forward step's tokens (sequence, position, phase, the step
itself, so a batched run replays batched) and, per MoE layer, top-k ids and weights, the full router scores, and optionally the router's input.

An encoder-decoder (Switch) is recorded as its decoder generates: one row per decoder token (the start token in
the prefill step, at position 0), the decoder's MoE layers as columns. The encoder's routing of the prompts runs
through other tokens — one row per prompt token — and is kept beside it as the trace's `encoder` (format.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from moetier.model.batch import StepBatch
from moetier.plan.route import PREFILL
from moetier.plan.step import LayerHook, RouteResult
from moetier.trace.format import Trace


class TraceRecorder(LayerHook):
    """with TraceRecorder(engine) as rec: engine.generate(...) (any number of calls); trace = rec.trace(prompts)

    A hook on the engine's forward steps and on its layer step's routes."""

    def __init__(self, engine, gate_inputs: bool = False) -> None:
        self.engine, self.gate_inputs = engine, gate_inputs
        s2s = engine.spec.encoder_decoder
        self.first = s2s.encoder_layers if s2s else 0  # layers before this one are the encoder's: its own table
        self.columns = {layer: j for j, layer in enumerate(x for x in engine.spec.moe_layers if x >= self.first)}
        self.encoder_columns = {layer: j for j, layer in enumerate(x for x in engine.spec.moe_layers if x < self.first)}
        self._encoded: dict[int, int] = {}  # an encoder-decoder's prompt length per KV row
        self._encoder_steps: list[dict] = []  # an encoder-decoder's prefills: the encoder's rows
        self._steps: list[dict] = []
        self._seq_offset = 0  # sequences of earlier generate calls
        self._call_seqs = 0  # sequences of the current call

    def __enter__(self) -> TraceRecorder:
        self.engine.executor.layer_step.hooks.append(self)
        self.engine.step_hooks.append(self._on_step)
        return self

    def __exit__(self, *exc) -> None:
        self.engine.executor.layer_step.hooks.remove(self)
        self.engine.step_hooks.remove(self._on_step)

    def _on_step(self, batch: StepBatch, phase: int) -> None:
        if phase == PREFILL:  # a generate call begins: its sequences follow the earlier calls'
            self._seq_offset += self._call_seqs
            self._call_seqs = len(batch.segments)
        rows, pos = batch.rows.cpu().numpy(), batch.positions.cpu().numpy().copy()
        if self.first and phase == PREFILL:  # the decoder's start token of each prompt
            self._encoded = {row: length for row, _, _, length in batch.segments}
            rows, pos = np.array(list(self._encoded)), np.zeros(len(self._encoded), np.int64)
            tokens = sorted(batch.segments, key=lambda s: s[1])  # the encoder's rows, in token order
            self._encoder_steps.append({
                "seq": np.concatenate([np.full(n, row + self._seq_offset) for row, _, _, n in tokens]),
                "pos": np.concatenate([np.arange(n) for *_, n in tokens]),
                "phase": np.full(sum(n for *_, n in tokens), PREFILL, np.uint8), "layers": {}})
        elif self.first:  # the decoder's own position
            pos = pos - np.array([self._encoded[r] for r in rows]) + 1
        self._steps.append({"seq": rows + self._seq_offset, "pos": pos, "step": np.full(len(rows), len(self._steps)),
                            "phase": np.full(len(rows), phase, np.uint8), "layers": {}})

    def on_route(self, route: RouteResult, gate_input: torch.Tensor) -> None:
        record = (route.topk_ids.copy(), route.topk_weights.copy(), route.scores.copy(),
                  gate_input.float().cpu().numpy() if self.gate_inputs else None)
        if route.layer < self.first:
            self._encoder_steps[-1]["layers"][self.encoder_columns[route.layer]] = record
        else:
            self._steps[-1]["layers"][self.columns[route.layer]] = record

    def trace(self, prompts: list[str], source: str = "", model: str | None = None) -> Trace:
        """The recorded steps as a trace; `model` names the model (default: the folder it was converted from, or
        the store's)."""
        model = model or Path(self.engine.store.manifest.source or self.engine.store.path).name
        source = source or f"recorded with moetier from {self.engine.store.path}"
        encoder = None
        if self._encoder_steps and self.encoder_columns:
            encoder = self._table(self._encoder_steps, self.encoder_columns, model, source, prompts, [
                "an encoder-decoder's encoder: one row per prompt token"])
        return self._table(self._steps, self.columns, model, source, prompts, self._notes(), encoder)

    def _table(self, steps: list[dict], columns: dict[int, int], model: str, source: str, prompts: list[str],
               notes: list[str], encoder: Trace | None = None) -> Trace:
        spec, cols = self.engine.spec, range(len(columns))

        def stack(i: int) -> np.ndarray:  # [N, L, ...]
            return np.concatenate([np.stack([s["layers"][j][i] for j in cols], axis=1) for s in steps])

        return Trace(
            model=model, num_layers=spec.num_layers, num_experts=spec.num_experts, top_k=spec.top_k,
            layers=list(columns), seq=np.concatenate([s["seq"] for s in steps]).astype(np.int32),
            pos=np.concatenate([s["pos"] for s in steps]).astype(np.int32),
            phase=np.concatenate([s["phase"] for s in steps]), topk_ids=stack(0).astype(np.int16),
            topk_weights=stack(1).astype(np.float16),
            step=np.concatenate([s["step"] for s in steps]).astype(np.int32) if "step" in steps[0] else None,
            scores=stack(2).astype(np.float16), gate_inputs=stack(3).astype(np.float16) if self.gate_inputs else None,
            source=source, prompts=prompts, notes=notes, encoder=encoder)

    def _notes(self) -> list[str]:
        spec = self.engine.spec
        notes = [] if spec.num_layers == len(spec.moe_layers) else [
            f"dense MLP layers {sorted(set(range(spec.num_layers)) - set(spec.moe_layers))} have no routing"]
        if self.first:
            notes.append(f"encoder-decoder: a row per decoder token; the encoder's MoE layers "
                         f"{list(self.encoder_columns)} route the prompts' tokens, kept in encoder/")
        return notes
