"""Records routing from moetier's own engine: every forward step's tokens (sequence, position, phase) and, per
MoE layer, top-k ids and weights, the full router scores, and optionally the router's input.

An encoder-decoder (Switch) is recorded as its decoder generates: one row per decoder token (the start token in
the prefill step, at position 0), the decoder's MoE layers as columns — a partial trace. The encoder's routing of
the prompt runs through other tokens and is not in it (the format has one routing row per token step)."""

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
        self.first = s2s.encoder_layers if s2s else 0  # layers before this one are the encoder's: not recorded
        self.columns = {layer: j for j, layer in enumerate(x for x in engine.spec.moe_layers if x >= self.first)}
        self._encoded: dict[int, int] = {}  # an encoder-decoder's prompt length per KV row
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
        elif self.first:  # the decoder's own position
            pos = pos - np.array([self._encoded[r] for r in rows]) + 1
        self._steps.append({"seq": rows + self._seq_offset, "pos": pos,
                            "phase": np.full(len(rows), phase, np.uint8), "layers": {}})

    def on_route(self, route: RouteResult, gate_input: torch.Tensor) -> None:
        if route.layer < self.first:
            return
        record = (route.topk_ids.copy(), route.topk_weights.copy(), route.scores.copy(),
                  gate_input.float().cpu().numpy() if self.gate_inputs else None)
        self._steps[-1]["layers"][self.columns[route.layer]] = record

    def trace(self, prompts: list[str], source: str = "", model: str | None = None) -> Trace:
        """The recorded steps as a trace; `model` names the model (default: the folder it was converted from, or
        the store's)."""
        spec = self.engine.spec
        cols = range(len(self.columns))

        def stack(i: int) -> np.ndarray:  # [N, L, ...]
            return np.concatenate([np.stack([s["layers"][j][i] for j in cols], axis=1) for s in self._steps])

        return Trace(
            model=model or Path(self.engine.store.manifest.source or self.engine.store.path).name, num_layers=spec.num_layers,
            num_experts=spec.num_experts, top_k=spec.top_k, layers=list(self.columns),
            seq=np.concatenate([s["seq"] for s in self._steps]).astype(np.int32),
            pos=np.concatenate([s["pos"] for s in self._steps]).astype(np.int32),
            phase=np.concatenate([s["phase"] for s in self._steps]),
            topk_ids=stack(0).astype(np.int16), topk_weights=stack(1).astype(np.float16),
            scores=stack(2).astype(np.float16), gate_inputs=stack(3).astype(np.float16) if self.gate_inputs else None,
            source=source or f"recorded with moetier from {self.engine.store.path}", prompts=prompts,
            notes=self._notes())

    def _notes(self) -> list[str]:
        spec = self.engine.spec
        notes = [] if spec.num_layers == len(spec.moe_layers) else [
            f"dense MLP layers {sorted(set(range(spec.num_layers)) - set(spec.moe_layers))} have no routing"]
        if self.first:
            notes.append(f"encoder-decoder: the decoder's tokens only; the encoder's MoE layers "
                         f"{[x for x in spec.moe_layers if x < self.first]} route the prompts and are not recorded")
        return notes
