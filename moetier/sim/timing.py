"""The simulator's clock: a replay's layer plans timed with a hardware profile's cost model.

One serial I/O queue for the slow tier (PreScope's premise: saturated transfers do not parallelise: a read holds
the link for its bytes over the bandwidth, its latency overlaps the next read), reads issued when a layer's routing is known (deferred ones when the expert whose slot they take is done), compute
of resident experts overlapping the reads, each loaded expert computed once its read has landed. Reads are
never interrupted."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.plan.layer_plan import LayerPlan
from moetier.sim.cost import CostModel
from moetier.sim.replay import ReplayResult, steps
from moetier.trace.format import DECODE, PREFILL, Trace


@dataclass
class LayerTimeline:
    layer: int
    start: float
    dense_end: float
    reads: list[tuple[int, float, float]] = field(default_factory=list)  # (expert, start, end)
    computes: list[tuple[int, float, float]] = field(default_factory=list)
    end: float = 0.0


@dataclass
class SimResult:
    step_phase: list[int]
    step_tokens: list[int]
    step_time_s: list[float]
    hit_rate: float
    bytes_read: list[int]  # per step
    miss_penalty_s: float  # the read time of every load, summed (HOBBIT's miss penalty)
    timelines: dict[int, list[LayerTimeline]]  # step index -> per-layer timeline, for the steps asked for

    def summary(self) -> dict:
        times, phase = np.asarray(self.step_time_s), np.asarray(self.step_phase)
        dec = phase == DECODE
        dec_tokens = int(np.asarray(self.step_tokens)[dec].sum())
        return {"tpot_s": float(times[dec].mean()) if dec.any() else None,
                "tpot_p50_s": float(np.percentile(times[dec], 50)) if dec.any() else None,
                "tpot_p90_s": float(np.percentile(times[dec], 90)) if dec.any() else None,
                "ttft_s": float(times[phase == PREFILL].mean()) if (phase == PREFILL).any() else None,
                "hit_rate": self.hit_rate,
                "expert_bytes_per_token": float(np.asarray(self.bytes_read)[dec].sum() / dec_tokens) if dec_tokens
                else None,
                "miss_penalty_s": self.miss_penalty_s}


def time_layer(plan: LayerPlan, start: float, tokens: int, cost: CostModel,
               link_free: float) -> tuple[LayerTimeline, float]:
    """Time one layer starting at `start` with the link busy until `link_free`; returns (timeline, link_free)."""
    # dense part, then the executor's own work (planning, grouping) before the reads go out
    tl = LayerTimeline(plan.layer, start, start + cost.dense_s(plan.layer, tokens))
    deferred = {ld.after: ld for ld in plan.loads if ld.after is not None}
    landed: dict[int, float] = {}

    def read(expert: int, ready: float) -> None:
        nonlocal link_free
        key = ExpertKey(plan.layer, expert)
        s = max(link_free, ready)
        link_free = s + cost.read_busy_s(key)
        landed[expert] = link_free + cost.read_latency_s(key)
        tl.reads.append((expert, s, landed[expert]))

    for ld in plan.loads:
        if ld.after is None:
            read(ld.expert, tl.dense_end)
    clock = tl.dense_end

    def compute(expert: int, ready: float) -> None:
        nonlocal clock
        s = max(clock, ready)
        clock = s + cost.expert_s(int(plan.counts[expert]))
        tl.computes.append((expert, s, clock))
        follower = deferred.pop(expert, None)
        if follower is not None:
            read(follower.expert, clock)

    for hit in plan.hits:
        compute(hit.expert, tl.dense_end)
    for ld in plan.loads:
        compute(ld.expert, landed[ld.expert])
    tl.end = clock
    return tl, link_free


def simulate(trace: Trace, replayed: ReplayResult, cost: CostModel,
             timeline_steps: tuple[int, ...] = ()) -> SimResult:
    """Time the plans of `replayed` (made from `trace`) with `cost`; keep per-layer timelines of the steps in
    `timeline_steps` (negative indices count from the end). Layers the trace does not cover run with their
    experts resident."""
    layers = len(trace.layers)
    traced = set(trace.layers)
    untraced = [layer for layer in range(cost.shape.num_layers) if layer not in traced]
    num_steps = len(replayed.plans) // layers
    timeline_steps = tuple(i % num_steps for i in timeline_steps)
    clock = link_free = penalty = 0.0
    phases, tokens, times, bytes_read, timelines = [], [], [], [], {}
    plans = iter(replayed.plans)
    for index, (phase, rows) in enumerate(steps(trace)):
        start, n = clock, len(rows)
        loads, keep = 0, index in timeline_steps
        for _ in range(layers):
            plan = next(plans)
            tl, link_free = time_layer(plan, clock, n, cost, link_free)
            clock, loads = tl.end, loads + len(plan.loads)
            penalty += sum(cost.read_s(ExpertKey(plan.layer, ld.expert)) for ld in plan.loads)
            if keep:
                timelines.setdefault(index, []).append(tl)
        clock += sum(cost.resident_layer_s(layer, n) for layer in untraced) + cost.head_s(n)
        phases.append(phase)
        tokens.append(n)
        times.append(clock - start)
        bytes_read.append(loads * cost.expert_bytes)
    return SimResult(phases, tokens, times, replayed.hit_rate, bytes_read, penalty, timelines)


def plot_timeline(timeline: list[LayerTimeline], path, title: str) -> None:
    """Per layer of one step: dense work, reads on the slow tier, expert compute (a Gantt chart)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.45 * len(timeline) + 1.5))
    t0 = timeline[0].start
    for i, tl in enumerate(timeline):
        ms = lambda t: (t - t0) * 1e3  # noqa: E731
        ax.barh(i + 0.25, ms(tl.dense_end) - ms(tl.start), left=ms(tl.start), height=0.3, color="0.6",
                label="dense + executor" if i == 0 else None)
        for j, (_, s, e) in enumerate(tl.computes):
            ax.barh(i + 0.25, ms(e) - ms(s), left=ms(s), height=0.3, color="tab:blue",
                    label="expert compute" if i == 0 and j == 0 else None)
        for j, (_, s, e) in enumerate(tl.reads):
            ax.barh(i - 0.15, ms(e) - ms(s), left=ms(s), height=0.3, color="tab:orange", edgecolor="white",
                    label="expert read" if j == 0 and not any(t.reads for t in timeline[:i]) else None)
    ax.set_yticks(range(len(timeline)), [f"layer {tl.layer}" for tl in timeline])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the step")
    ax.set_title(title)
    ax.legend(loc="lower left")  # the diagonal of layers leaves that corner empty
    fig.tight_layout()
    fig.savefig(path, dpi=110)
