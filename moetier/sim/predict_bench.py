"""`moetier predict-bench`: every predictor on the same recorded traces, per layer distance — recall of the true
top-k among the predicted top-k (DESIGN.md), PreScope's Top-4-within-Top-6, and the predictor's cost per token.

Each trace is split in time as cache-bench splits it: what a predictor learns from a trace (hot's use counts) it
learns from the first part; every predictor is scored on the decode steps of the rest (batch 1, as traces
replay), after hearing every step of it in order, prefill included."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from moetier.plan.route import DECODE
from moetier.predict import Predictor
from moetier.predict.quality import recall, top4_within_top6
from moetier.sim.replay import steps, trace_route
from moetier.trace.format import Trace


@dataclass(frozen=True)
class PredictRecord:
    trace: str
    predictor: str
    distance: int  # MoE layers ahead
    recall: float  # of the true top-k (token, expert) pairs, the share among the predicted top-k
    top4_within_top6: float  # PreScope's Table 3 measure
    cost_us_per_token: float  # observe + predict, every layer of a decode step, per token
    pairs: int  # (decode step, predicting layer) pairs scored at this distance


def evaluate(trace: Trace, predictor: Predictor, name: str, label: str) -> list[PredictRecord]:
    """Drive `predictor` through `trace` and score it per distance."""
    column = {layer: j for j, layer in enumerate(trace.layers)}
    recalls: dict[int, list[float]] = {}
    tops: dict[int, list[float]] = {}
    cost_s, decode_tokens, seq = 0.0, 0, None
    for index, (phase, rows) in enumerate(steps(trace)):
        if trace.seq[rows[0]] != seq:
            seq = trace.seq[rows[0]]
            predictor.on_sequence_start()
        decode_tokens += len(rows) if phase == DECODE else 0
        for j, layer in enumerate(trace.layers):
            route = trace_route(trace, rows, j, layer, index + 1)
            gate_input = trace.gate_inputs[rows, j] if trace.gate_inputs is not None else None
            start = time.perf_counter()
            predictor.observe(layer, gate_input, route)
            predictions = predictor.predict(layer, gate_input)
            if phase != DECODE:
                continue
            cost_s += time.perf_counter() - start
            for f, scores in predictions.items():
                distance = column[f] - j
                true_ids = trace.topk_ids[rows, column[f]].astype(np.int64)
                true_scores = trace_route(trace, rows, column[f], f, index + 1).scores
                recalls.setdefault(distance, []).append(recall(scores, true_ids))
                tops.setdefault(distance, []).append(top4_within_top6(scores, true_ids, true_scores))
    per_token = cost_s / decode_tokens * 1e6 if decode_tokens else float("nan")
    return [PredictRecord(label, name, d, float(np.mean(recalls[d])), float(np.mean(tops[d])), per_token,
                          len(recalls[d])) for d in sorted(recalls)]


def predict_bench(traces: dict[str, Trace], predictors: dict[str, Callable[[Trace, Trace], Predictor]],
                  train_share: float = 0.3, progress: bool = True) -> list[PredictRecord]:
    """`predictors`: name -> make(first part, whole trace) for each trace."""
    from moetier.progress import tqdm

    records = []
    bar = tqdm(total=len(traces) * len(predictors), desc="predict-bench", unit="run", disable=not progress)
    for label, trace in traces.items():
        train, test = trace.split(train_share)
        for name, make in predictors.items():
            records += evaluate(test, make(train, trace), name, label)
            bar.update()
    bar.close()
    return records


def format_table(records: list[PredictRecord]) -> str:
    lines = [f"{'trace':>24} {'predictor':>14} {'dist':>4} {'recall':>7} {'top4/6':>7} {'µs/token':>9} {'pairs':>6}"]
    for r in records:
        lines.append(f"{r.trace[-24:]:>24} {r.predictor:>14} {r.distance:>4} {r.recall:>7.1%} "
                     f"{r.top4_within_top6:>7.1%} {r.cost_us_per_token:>9.0f} {r.pairs:>6}")
    return "\n".join(lines)


def plot(records: list[PredictRecord], path: Path) -> None:
    """Recall against layer distance, one panel per trace, one line per predictor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r.trace for r in records))
    fig, axes = plt.subplots(1, len(traces), figsize=(4.5 * len(traces), 3.8), squeeze=False)
    for ax, label in zip(axes[0], traces):
        mine = [r for r in records if r.trace == label]
        for name in dict.fromkeys(r.predictor for r in mine):
            rs = [r for r in mine if r.predictor == name]
            ax.plot([r.distance for r in rs], [r.recall * 100 for r in rs], marker="o", label=name)
        ax.set_title(Path(label).name, fontsize=9)
        ax.set_xlabel("MoE layers ahead")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("recall of the true top-k, %")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("next-layer expert prediction (held-out decode steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def to_json(records: list[PredictRecord]) -> list[dict]:
    return [asdict(r) for r in records]
