"""The simulated executor: it carries out the same plans as the real executor, through the same layer step, on a
discrete-event clock instead of a disk and kernels — so a read is timed while it is planned, and a prefetch is a
hit only if its read has landed when its layer needs it.

The machine it models (a hardware profile priced by a CostModel): one serial link from the slow tier (PreScope's
premise: saturated transfers do not parallelise; a read holds the link for its bytes over the bandwidth, its
latency overlaps the next read, and it is never interrupted), and two compute lanes — the compute device, which
holds the cache and runs the dense layers, and the host CPU, for experts computed where their weights live. A
layer's dense part runs first; its routing is known when that ends, and its reads go out then (a read that takes
the slot of an expert computed earlier in the layer waits for that compute); resident experts compute while
reads land, each loaded one once its read has."""

from __future__ import annotations

from dataclasses import dataclass, field

from moetier.cache.keys import ExpertKey
from moetier.plan.layer_plan import FAST, HOST, IN_FLIGHT, LOAD, LayerPlan, Load
from moetier.plan.route import RouteResult
from moetier.plan.step import LayerStep
from moetier.sim.cost import CostModel


@dataclass
class LayerTimeline:
    layer: int
    start: float
    dense_end: float
    reads: list[tuple[ExpertKey, float, float]] = field(default_factory=list)  # (key, start, data usable)
    computes: list[tuple[int, float, float, str]] = field(default_factory=list)  # (expert, start, end, lane)
    end: float = 0.0


class SimExecutor:
    def __init__(self, layer_step: LayerStep, cost: CostModel) -> None:
        self.layer_step, self.cost = layer_step, cost
        self.residency = layer_step.residency
        self.now = 0.0  # the compute device's clock: where the next piece of work starts
        self.link_free = 0.0  # the link is busy until then
        self.host_free = 0.0  # the host CPU lane is busy until then
        self.landing: dict[ExpertKey, float] = {}  # prefetches in flight: when each one's data is usable

    def layer(self, route: RouteResult, tokens: int) -> tuple[LayerPlan, LayerTimeline]:
        """One MoE layer of `tokens` tokens, starting now."""
        tl = LayerTimeline(route.layer, self.now, self.now + self.cost.dense_s(route.layer, tokens))
        self._land(tl.dense_end)  # what a layer needs was in time if its read landed before its routing is known
        plan = self.layer_step.begin(route)
        landed: dict[int, float] = {}
        deferred: dict[int, Load] = {}
        for load in plan.loads:
            if load.after is None:
                landed[load.expert] = self._read(ExpertKey(plan.layer, load.expert), tl.dense_end, tl)
            else:
                deferred[load.after] = load
        for prefetch in plan.prefetches:
            self.landing[prefetch.key] = self._read(prefetch.key, tl.dense_end, tl)
        lane_free = {FAST: tl.dense_end, HOST: max(self.host_free, tl.dense_end)}
        counts = plan.counts
        for run in plan.runs:
            key = ExpertKey(plan.layer, run.expert)
            ready = landed[run.expert] if run.source == LOAD else \
                self.landing.pop(key) if run.source == IN_FLIGHT else tl.dense_end
            start = max(lane_free[run.place], ready)
            lane_free[run.place] = start + self.cost.expert_s(int(counts[run.expert]), run.place)
            tl.computes.append((run.expert, start, lane_free[run.place], run.place))
            follower = deferred.pop(run.expert, None)
            if follower is not None:  # its slot is free now
                landed[follower.expert] = self._read(ExpertKey(plan.layer, follower.expert), lane_free[run.place], tl)
        self.host_free = lane_free[HOST]
        tl.end = self.now = max([lane_free[FAST]] + [end for _, _, end, _ in tl.computes])  # all runs done
        for prefetch in self.layer_step.end(plan):
            self.landing[prefetch.key] = self._read(prefetch.key, self.now, tl)
        return plan, tl

    def idle(self, seconds: float) -> None:
        """Work on the compute device that involves no expert of the cache (dense layers, the head)."""
        self.now += seconds

    def _read(self, key: ExpertKey, ready: float, tl: LayerTimeline) -> float:
        """Queue a read on the serial link at `ready`; returns when its data is usable."""
        start = max(self.link_free, ready)
        self.link_free = start + self.cost.read_busy_s(key)
        usable = self.link_free + self.cost.read_latency_s(key)
        tl.reads.append((key, start, usable))
        return usable

    def _land(self, now: float) -> None:
        for key, usable in list(self.landing.items()):
            if usable <= now:
                del self.landing[key]
                self.residency.landed(key)
