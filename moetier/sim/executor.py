"""The simulated executor: it carries out the same plans as the real executor, through the same layer step, on a
discrete-event clock instead of a disk and kernels — so a read is timed while it is planned, and a prefetch is a
hit only if its read has landed when its layer needs it.

The machine it models (a hardware profile priced by a CostModel): one serial link from the slow tier (PreScope's
premise: saturated transfers do not parallelise; a read holds the link for its bytes over the bandwidth, its
latency overlaps the next read, and it is never interrupted), and two compute lanes — the compute device, which
holds the cache and runs the dense layers, and the host CPU, for experts computed where their weights live. A
layer's dense part runs first (and a predictor's scoring, where one runs); its routing is known when that ends,
and its reads go out then (a read that takes the slot of an expert computed earlier in the layer waits for that
compute); resident experts compute while reads land, each loaded one once its read has. Where the profile says a
read costs the computing CPU (this machine: the reader's threads share its two cores), a layer takes longer by the
CPU its overlapping reads took. Where it prices the host thread that issues a GPU's work (`host_issue`,
moetier/sim/host_issue.py), a layer whose routing that thread reads plans first, queues each read before it can
start, and ends no earlier than the thread's work for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from moetier.cache.keys import ExpertKey
from moetier.cache.residency import PREFETCHED
from moetier.plan.costs import RunningCosts
from moetier.plan.layer_plan import FAST, HOST, IN_FLIGHT, LOAD, LayerPlan, Load
from moetier.plan.route import RouteResult
from moetier.plan.step import LayerStep
from moetier.sim.cost import CostModel
from moetier.sim.host_cache import HostCache
from moetier.sim.host_issue import HostLane


@dataclass
class LayerTimeline:
    layer: int
    start: float
    dense_end: float
    reads: list[tuple[ExpertKey, float, float]] = field(default_factory=list)  # (key, start, data usable)
    computes: list[tuple[int, float, float, str]] = field(default_factory=list)  # (expert, start, end, lane)
    end: float = 0.0


class SimExecutor:
    def __init__(self, layer_step: LayerStep, cost: CostModel, costs: RunningCosts | None = None,
                 host: HostCache | None = None, lane: HostLane | None = None) -> None:
        """`costs`: where the stages that weigh time hear what layers cost (the cost model's numbers). `host`: a
        host tier behind the cache (a GPU's three tiers): a load it holds is a copy over the link (the profile's
        first tier); one it does not is first read from the disk (its last tier) into it — the disk and the link
        each busy on their own, as the engine's reader threads and copy stream are. None: each expert in its
        profile tier, read over one link. `lane`: the host thread that issues a GPU's work, in the layers
        `routed` says it reads the routing of (None: a host that keeps ahead)."""
        self.layer_step, self.cost, self.costs, self.host, self.lane = layer_step, cost, costs, host, lane
        self.routed = True  # whether this step's layers read their routing on the host (set by the replay each step)
        self._host_at = 0.0  # the host's thread, within a layer: when it has queued the copies asked so far
        self._copy_s = 0.0  # the host's work to queue a copy in this layer (0 where the host is not priced)
        # the last layer the host's thread was priced in, and when that thread was done with it (its prefetches
        # queued): what the engine's clock for the next layer's dense part starts from
        self._host_end: tuple[int, float] | None = None
        self.residency = layer_step.residency
        self.now = 0.0  # the compute device's clock: where the next piece of work starts
        self.link_free = 0.0  # the link is busy until then
        self.disk_free = 0.0  # behind a host tier: the disk is busy until then
        self._idle_s: dict[ExpertKey, float] = {}  # behind a host tier: each key's last load on idle resources
        self.host_free = 0.0  # the host CPU lane is busy until then
        self.landing: dict[ExpertKey, float] = {}  # reads in flight for coming layers: when each one's data is usable
        self.queued: dict[ExpertKey, float] = {}  # prefetches waiting for the link, in order: when each was issued
        self._tl: LayerTimeline | None = None  # the layer whose timeline a read started now is drawn in
        self._reading: list[tuple[float, float, float]] = []  # reads that take CPU: (start, end, CPU s per s)
        self._by_precision: dict[str, CostModel] = {}

    def layer(self, route: RouteResult, tokens: int, gate_input=None) -> tuple[LayerPlan, LayerTimeline]:
        """One MoE layer of `tokens` tokens, starting now. `gate_input` [T, H]: the router's input, for the
        predictor (a trace's recorded one), or None."""
        dense_s = self.cost.dense_s(route.layer, tokens)
        if self.layer_step.predictor is not None:  # it scores the coming layers before this one is planned
            dense_s += self.cost.predict_s(tokens)
        tl = self._tl = LayerTimeline(route.layer, self.now, self.now + dense_s)
        self._land(tl.dense_end)  # what a layer needs was in time if its read landed before its routing is known
        plan = self.layer_step.begin(route, gate_input)
        for key in plan.cancels:  # prefetches this layer proved wrong: off the queue if they never started
            if self.queued.pop(key, None) is not None:
                plan.cancelled.append((key, self.residency.entries[key].precision))
                self.residency.drop(key)
        landed: dict[int, float] = {}
        for run in plan.runs:  # prefetches this layer needs, still queued: on-demand now, ahead of its loads
            key = ExpertKey(plan.layer, run.expert)
            if run.source == IN_FLIGHT and self.queued.pop(key, None) is not None:  # (the queue has advanced
                self.landing[key] = self._start(key, tl.dense_end, run.precision)  # to dense_end in _land)
        priced = self.lane is not None and self.routed  # (the host's thread priced in this layer)
        self._copy_s = self.lane.issue.load_s if priced else 0.0
        self._host_at = tl.dense_end + (self.lane.planning_s if priced else 0.0)  # its clock as it queues copies
        deferred: dict[int, Load] = {}
        for load in plan.loads:  # on-demand reads: ahead of every queued prefetch
            if load.after is None:
                landed[load.expert] = self._read(ExpertKey(plan.layer, load.expert), self._queue_copy(),
                                                 load.precision)
            else:
                deferred[load.after] = load
        for prefetch in plan.prefetches:
            self.queued[prefetch.key] = self._queue_copy()
        lane_free = {FAST: tl.dense_end, HOST: max(self.host_free, self._host_at)}
        counts = plan.counts
        for run in plan.runs:
            key = ExpertKey(plan.layer, run.expert)
            ready = landed[run.expert] if run.source == LOAD else \
                self._in_flight(key) if run.source == IN_FLIGHT else tl.dense_end
            start = max(lane_free[run.place], ready)
            lane_free[run.place] = start + self.cost_at(run.precision).expert_s(int(counts[run.expert]), run.place)
            tl.computes.append((run.expert, start, lane_free[run.place], run.place))
            follower = deferred.pop(run.expert, None)
            if follower is not None:  # its slot is free now (and the host has queued it)
                landed[follower.expert] = self._read(ExpertKey(plan.layer, follower.expert),
                                                     max(lane_free[run.place], self._queue_copy()),
                                                     follower.precision)
        self.host_free = lane_free[HOST]
        host_done = max(self._host_at, lane_free[HOST]) + self.lane.issue.launch_s if priced else 0.0  # (its own
        # lane's experts computed in the same thread, then the launches)
        tl.end = self.now = max([lane_free[FAST], host_done]
                                + [end for _, _, end, _ in tl.computes])  # all runs done, and the host's work
        self._advance(tl.end)  # reads that start while this layer runs are drawn in its timeline
        tl.end = self.now = tl.end + self._cpu_taken(tl)
        self._advance(tl.end)
        after = self.layer_step.end(plan)
        for prefetch in after:
            self.queued[prefetch.key] = self.now = self.now + self._copy_s  # (the host queues each)
        self._observe(plan, tokens, self._dense_seen(tl, tokens, priced))
        self._host_end = (plan.layer, host_done + len(after) * self._copy_s) if priced else None
        return plan, tl

    def _dense_seen(self, tl: LayerTimeline, tokens: int, priced: bool) -> float:
        """A layer's dense part as the engine's clock sees it (ExpertExecutor: from the host's end of the layer
        before to this one's routing back on the host, so it holds whatever the device still had queued): where
        the host's thread is priced in both layers of one step, from that thread's end of the last to this
        routing; else the cost model's dense part (a host that keeps ahead sees the device's)."""
        last = self._host_end
        if priced and last is not None and last[0] < tl.layer:
            return max(0.0, tl.dense_end - last[1])
        return self.cost.dense_s(tl.layer, tokens)

    def _queue_copy(self) -> float:
        """The host queues one more of the layer's copies: when it is done with it (the layer's routing, where the
        host is not priced)."""
        self._host_at += self._copy_s
        return self._host_at

    def resize(self, capacity_bytes: int, order=None) -> list[ExpertKey]:
        """The cache resized between steps as the engine's executor resizes it: the reads in flight land first (the
        clock waits for them; a read is never interrupted), prefetched experts become plain entries, then the
        residency shrinks by the policy or `order` (Residency.resize) or grows. Returns the evicted keys."""
        if self.queued:
            self._advance(float("inf"))  # (queued prefetches start behind the running ones)
        if self.landing:
            self.now = max(self.now, *self.landing.values())
        self._land(self.now)
        self.residency.unpin_all(PREFETCHED)
        return self.residency.resize(capacity_bytes, order)

    def idle(self, seconds: float) -> None:
        """Work on the compute device that involves no expert of the cache (dense layers, the head)."""
        self.now += seconds

    def _read(self, key: ExpertKey, ready: float, precision: str) -> float:
        """An on-demand read at `ready`: prefetches that started before it keep the link (a read is never
        interrupted), queued ones wait behind it. Returns when its data is usable."""
        self._advance(ready)
        return self._start(key, ready, precision)

    def _in_flight(self, key: ExpertKey) -> float:
        """When a read an earlier layer started is usable (one still queued was promoted when the layer routed)."""
        return self.landing.pop(key)

    def _advance(self, t: float) -> None:
        """Queued prefetches that the link (or, for one not in the host tier, the disk) starts before `t`, in
        order."""
        while self.queued:
            key, ready = next(iter(self.queued.items()))
            precision = self.residency.entries[key].precision
            if max(self._free_for(key, precision), ready) >= t:
                return
            del self.queued[key]
            self.landing[key] = self._start(key, ready, precision)  # (pinned: there)

    def _free_for(self, key: ExpertKey, precision: str) -> float:
        """When the resource a read of `key` starts on is free: the disk for one a host tier does not hold."""
        return self.disk_free if self.host is not None and (key, precision) not in self.host else self.link_free

    def _cpu_taken(self, tl: LayerTimeline) -> float:
        """The CPU that reads running beside this layer's compute took from it, where the compute device is the
        CPU that reads (a 2-core machine: a reader thread preempts one of the kernel's threads and the kernel
        waits for its slowest): each read's CPU spread over the time it holds the link, times its overlap with
        the dense part and the experts computed on the compute device. First order: the layer ends that much
        later; its computes are not shifted."""
        if not self._reading:
            return 0.0
        self._reading = [r for r in self._reading if r[1] > tl.start]
        busy = [(tl.start, tl.dense_end), *((a, b) for _, a, b, place in tl.computes if place == FAST)]
        return sum(rate * max(0.0, min(b, end) - max(a, start)) for start, end, rate in self._reading
                   for a, b in busy)

    def idle_read_s(self, key: ExpertKey, precision: str) -> float:
        """What the last load of `key` takes on idle resources, request to usable data (HOBBIT's miss penalty): its
        read over the profile's tiers, or behind a host tier its copy, after a disk read where it missed there."""
        if self.host is None:
            return self.cost_at(precision).read_s(key)
        return self._idle_s[key]

    def cost_at(self, precision: str) -> CostModel:
        """The cost model for experts at `precision` (a mixed-precision plan reads and computes several)."""
        cost = self._by_precision.get(precision)
        if cost is None:
            cost = self._by_precision[precision] = self.cost.at(precision)
        return cost

    def _start(self, key: ExpertKey, ready: float, precision: str) -> float:
        cost = self.cost_at(precision)
        if self.host is not None:
            return self._start_tiered(key, ready, precision, cost)
        start = max(self.link_free, ready)
        self.link_free = start + cost.read_busy_s(key)
        cpu = cost.read_cpu_s(key)
        if cpu and self.link_free > start:
            self._reading.append((start, self.link_free, cpu / (self.link_free - start)))
        usable = self.link_free + cost.read_latency_s(key)
        self._tl.reads.append((key, start, usable))
        return usable

    def _start_tiered(self, key: ExpertKey, ready: float, precision: str, cost: CostModel) -> float:
        """A load behind a host tier: a copy from host memory, after a read from the disk into it where the tier
        does not hold the expert (TieredDeviceSlots: the copy is queued once the read lands)."""
        disk = None
        if not self.host.lookup(key, precision):
            self.host.admit(key, precision)
            disk = max(self.disk_free, ready)
            self.disk_free = disk + cost.disk_busy_s()
            ready = self.disk_free + cost.disk_latency_s()
        copy = max(self.link_free, ready)
        start = copy if disk is None else disk  # (drawn from the disk read where there is one)
        self.link_free = copy + cost.copy_busy_s()
        usable = self.link_free + cost.copy_latency_s()
        self._idle_s[key] = cost.copy_busy_s() + cost.copy_latency_s() + (
            0.0 if disk is None else cost.disk_busy_s() + cost.disk_latency_s())
        self._tl.reads.append((key, start, usable))
        return usable

    def _land(self, now: float) -> None:
        self._advance(now)
        for key, usable in list(self.landing.items()):
            if usable <= now:
                del self.landing[key]
                self.residency.landed(key)

    def _observe(self, plan: LayerPlan, tokens: int, dense_s: float) -> None:
        """What the stages that weigh time hear: the cost model's own numbers for this layer (its dense part as
        the engine's clock sees it: `dense_s`)."""
        if self.costs is None:
            return
        counts = plan.counts
        per_expert = max(1, int(round(counts.sum() / max(1, len(plan.runs)))))  # tokens an expert of this layer took
        self.costs.observe_dense(dense_s)
        self.costs.observe_expert(self.cost.expert_s(per_expert))
        self.costs.observe_host(per_expert, self.cost.expert_s(per_expert, HOST))  # what computing in place costs
        self.costs.observe_read(self.costs.expert_bytes, self.cost.read_busy_s(ExpertKey(plan.layer, 0)))
