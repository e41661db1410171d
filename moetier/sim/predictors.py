"""Predictors for replaying a trace: the ones built on the trace itself (the true routing for `oracle`, use counts
for `hot`), and `stacked-gates` from the model's routers and the trace's recorded gate inputs. The simulator's
counterpart of the engine's predictor_inputs."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from moetier.errors import MoetierError
from moetier.predict import Predictor, make_predictor
from moetier.sim.replay import layer_visits, steps
from moetier.trace.format import Trace


def trace_truth(trace: Trace):
    """(forward step, layer) -> topk_ids [T, k] of that step, steps numbered as the replay's layer step does; an
    encoder-decoder's encoder layers give the encoder's rows of the step's prompts (at its prefill steps)."""
    encoder_rows = trace.encoder_rows()
    visits = [{layer: (table, rows, j) for table, rows, j, layer in layer_visits(trace, r, encoder_rows)}
              for _, r in steps(trace)]

    def truth(step: int, layer: int) -> np.ndarray:
        table, rows, j = visits[step - 1][layer]
        return table.topk_ids[rows, j]

    return truth


def trace_counts(trace: Trace) -> dict[int, np.ndarray]:
    """Per layer (an encoder's too), how often each expert was selected in `trace` [E]."""
    tables = [trace.encoder, trace] if trace.encoder is not None else [trace]
    return {layer: np.bincount(t.topk_ids[:, j].ravel().astype(np.int64), minlength=trace.num_experts)
            for t in tables for j, layer in enumerate(t.layers)}


def check_replayable(name: str) -> None:
    """Refuse a predictor a trace cannot drive, saying where it can run."""
    if name == "smoe-lookahead":
        raise MoetierError("smoe-lookahead runs the model's next attention layer on the hidden state, which a trace "
                           "does not hold", hint="measure it in the engine: `moetier generate --predictor "
                           "smoe-lookahead` reports its recall live (python bench/bench_predict.py tabulates it)")


def trace_predictor(name: str, trace: Trace, distance: int = 1, routers: Mapping | None = None,
                    counts: Mapping | None = None, error_rate: float = 0.0, nets: Mapping | None = None
                    ) -> Predictor | None:
    """Predictor `name` for replaying `trace` (None for "none"). `hot` counts the trace itself unless `counts` are
    given (a profile of other text: the honest setting); `stacked-gates` needs `routers`, the trained ones `nets`,
    and both the trace's gate inputs."""
    if name == "none":
        return None
    check_replayable(name)
    inputs: dict = {}
    if name == "oracle":
        inputs = {"truth": trace_truth(trace), "error_rate": error_rate}
    elif name == "hot":
        inputs = {"counts": counts if counts is not None else trace_counts(trace)}
    elif name in ("stacked-gates", "llapor", "comoe-mlp"):
        if trace.gate_inputs is None or (trace.encoder is not None and trace.encoder.gate_inputs is None):
            raise MoetierError(f"{name} predicts from the router's input, and this trace has none",
                               hint="record it with `moetier trace record --gate-inputs`")
        inputs = {"routers": routers} if name == "stacked-gates" else {"nets": nets}
    return make_predictor(name, trace.all_layers, trace.num_experts, trace.top_k, distance, **inputs)
