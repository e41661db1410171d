"""Counting what layer steps did, per phase, as DESIGN.md defines the measures: a hook both executors attach."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from moetier.cache.keys import Precision
from moetier.plan.layer_plan import HOST, SKIP, LayerPlan
from moetier.plan.step import LayerHook
from moetier.predict.quality import top_ids


@dataclass
class PhaseCounters:
    layer_steps: int = 0
    needed: int = 0  # (layer step, distinct expert needed) pairs
    hits: int = 0  # of those, resident when the layer needed them
    loads: int = 0
    bytes_read: int = 0
    miss_penalty_bytes: int = 0  # HOBBIT's miss penalty, in bytes of the precision loaded
    prefetches: int = 0  # reads issued for coming layers
    prefetch_used: int = 0  # needed by their layer and landed in time: hits
    prefetch_late: int = 0  # needed, but still reading when their layer needed them
    prefetch_wasted: int = 0  # not needed by the layer they were read for
    prefetch_cancelled: int = 0  # of the wasted, reads cancelled before they started (nothing read)
    predicted: int = 0  # true (token, expert) pairs of layers the predictor scored one MoE layer ahead
    predicted_right: int = 0  # of those, among the predicted top-k: the predictor's recall (DESIGN.md) live
    low_runs: int = 0  # needed experts computed below the high precision (a precision stage's choice)
    low_loads: int = 0  # of the loads, those of a low-precision copy
    skipped: int = 0  # (token, k) assignments a precision stage skipped
    substituted: int = 0  # (token, k) assignments given another expert than the router's (a substitution stage)
    host_runs: int = 0  # needed experts computed where their weights live (a placement stage's choice)

    def add_hits(self, experts: int) -> None:
        """A layer step whose `experts` distinct experts were all resident and computed at the run's one precision:
        what `add` counts for such a plan, for the paths that skip making one (ResidentLayers, HitLayer)."""
        self.layer_steps += 1
        self.needed += experts
        self.hits += experts

    def add(self, plan: LayerPlan, entry_bytes: Mapping[Precision, int], high: Precision | None = None) -> None:
        """`high`: the run's high precision (None: count no low runs)."""
        self.layer_steps += 1
        if high is not None:
            self.low_runs += sum(1 for run in plan.runs if run.precision != high)
            self.low_loads += sum(1 for load in plan.loads if load.precision != high)
        # an untouched assignment is the routing's own array (nothing skipped): no count on exact plans
        if plan.assign_ids is not plan.route.topk_ids:
            ids = plan.assign_ids
            self.skipped += int((ids == SKIP).sum())
            self.substituted += int(((ids != plan.route.topk_ids) & (ids != SKIP)).sum())
        self.needed += len(plan.runs)
        self.host_runs += sum(1 for run in plan.runs if run.place == HOST)
        self.hits += len(plan.hits)
        self.loads += len(plan.loads)
        read = sum(entry_bytes[load.precision] for load in plan.loads)
        self.bytes_read += read + sum(entry_bytes[p.precision] for p in plan.prefetches) - \
            sum(entry_bytes[precision] for _, precision in plan.cancelled)  # (those never read)
        self.miss_penalty_bytes += read
        self.prefetches += len(plan.prefetches)
        self.prefetch_used += plan.prefetch_used
        self.prefetch_late += plan.prefetch_late
        self.prefetch_wasted += plan.prefetch_wasted
        self.prefetch_cancelled += len(plan.cancelled)


PREFETCH_FIELDS = {"issued": "prefetches", "used": "prefetch_used", "late": "prefetch_late",
                   "wasted": "prefetch_wasted", "cancelled": "prefetch_cancelled"}


def prefetch_summary(phases) -> dict[str, int]:
    """Prefetches issued, used in time, late, wasted and cancelled unread, over `phases`."""
    return {name: sum(getattr(p, f) for p in phases) for name, f in PREFETCH_FIELDS.items()}


def predictor_recall(counters: PhaseCounters) -> float | None:
    return counters.predicted_right / counters.predicted if counters.predicted else None


class CountingHook(LayerHook):
    """Adds each layer to the counters of its phase; `phases` is swapped per generate call. Scores the predictor
    as it runs: each layer's prediction of the next MoE layer against that layer's routing, in the same step."""

    def __init__(self, entry_bytes: Mapping[Precision, int], high: Precision | None = None) -> None:
        self.entry_bytes, self.high = entry_bytes, high
        self.phases = (PhaseCounters(), PhaseCounters())
        self.pending: dict[int, np.ndarray] = {}  # next MoE layer -> predicted top-k ids [T, k], until it routes

    def on_plan(self, plan: LayerPlan, phase: int) -> None:
        counters = self.phases[phase]
        counters.add(plan, self.entry_bytes, self.high)
        guess = self.pending.pop(plan.layer, None)
        true_ids = plan.route.topk_ids  # [T, k]
        if guess is not None and guess.shape[0] == true_ids.shape[0]:
            counters.predicted += true_ids.size
            counters.predicted_right += int((guess[:, :, None] == true_ids[:, None, :]).any(1).sum())
        if plan.predictions:
            nearest = min(plan.predictions)  # the next MoE layer: layers ascend
            self.pending[nearest] = top_ids(plan.predictions[nearest], true_ids.shape[1])
