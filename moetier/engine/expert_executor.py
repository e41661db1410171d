"""The real executor for routed experts: for each MoE layer, the layer step plans, and this carries the plan out —
reads into slots on the reader's threads, kernels on the model's device — computing resident experts while the
reads land, then each loaded expert as it arrives."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.base import EvictionPolicy
from moetier.cache.residency import PREFETCHED
from moetier.config import ModelSpec
from moetier.engine.copy_queue import COPY_ORDERS
from moetier.engine.grouping import ExpertGroups
from moetier.engine.hit_layer import HitLayer
from moetier.engine.host_tier import HostTier
from moetier.engine.one_token import OneToken
from moetier.engine.resident_layers import ResidentLayers
from moetier.engine.route_arrays import route_arrays_with
from moetier.engine.slots import make_slots
from moetier.engine.tiered_slots import TieredDeviceSlots
from moetier.errors import MoetierError
from moetier.model.expert_kernels import make_expert_kernel
from moetier.model.kernels import TorchKernels
from moetier.plan.costs import RunningCosts
from moetier.plan.counters import CountingHook, PhaseCounters
from moetier.plan.device_memory import device_memory
from moetier.plan.layer_plan import HOST, IN_FLIGHT, RESIDENT, LayerPlan, Load, Prefetch, Run
from moetier.plan.on_demand import OnDemandStage
from moetier.plan.pipeline import plan_stages
from moetier.plan.planner import Planner
from moetier.plan.precision import MixedPrecision, setup
from moetier.plan.route import RouteResult
from moetier.plan.similar_substitute import SimilarSubstitution
from moetier.plan.step import LayerStep
from moetier.plan.substitute import Substitution, SubstitutionStage
from moetier.predict.base import Predictor
from moetier.store.format import Manifest
from moetier.store.reader import ON_DEMAND, PREFETCH, ExpertReader


class ExpertExecutor:
    def __init__(self, spec: ModelSpec, manifest: Manifest, capacity_bytes: int, policy: EvictionPolicy,
                 reader: ExpertReader, per_layer: bool = False, device: torch.device | str = "cpu",
                 kernels: TorchKernels | None = None, prefetch: str = "none", predictor: Predictor | None = None,
                 prefetch_params: dict | None = None, mixed: MixedPrecision | None = None,
                 dtype: torch.dtype = torch.bfloat16,
                 substitution: Substitution | SimilarSubstitution | None = None,
                 placement: str = "none", host_kernels: TorchKernels | None = None,
                 host_tier: HostTier | None = None, copy_order: str = "demand-first") -> None:
        """`prefetch`: a stage of moetier.plan.prefetchers (or "none"), choosing reads from `predictor`'s scores.
        `mixed`: the precision mode (default: every expert at the model's own). `dtype`: the activations'.
        `substitution`: SMoE's (α None: the paper's for the model's size), or None. `placement`: a stage of
        moetier.plan.placement choosing per missing expert between a read into the cache and computing it on the
        host CPU from the host tier — every expert at the model's precision in host memory, read at start-up —
        with `host_kernels` (the CPU's; default `kernels`, right when the device is the CPU itself). `host_tier`: the
        host memory behind a GPU's cache (engine/host_tier.py): the device's slots load from it, and placement
        computes from it where it holds every expert. `copy_order`: how the copies from it are queued on the
        device's copy stream (engine/copy_queue.py: "demand-first", or "fifo" as first measured)."""
        self.spec, self.manifest, self.reader, self.policy = spec, manifest, reader, policy
        self.kernels = kernels or TorchKernels()
        self.device = torch.device(device)
        self.mixed = mixed = mixed or MixedPrecision()
        native = manifest.native_precision
        missing = [p for p in mixed.precisions(native) if p not in manifest.precisions]
        if missing:
            raise MoetierError(f"the store holds its experts at {', '.join(manifest.precisions)}, not "
                               f"{', '.join(missing)}", hint=f"add them: moetier quantize STORE --precisions "
                                                             f"{','.join(missing)}")
        entry_bytes = {p: layout.blob_bytes for p, layout in manifest.precisions.items()}
        made = setup(mixed, native, entry_bytes, capacity_bytes, policy, spec.moe_layers, spec.num_experts,
                     spec.top_k, per_layer, spec.expert_keys())
        self.precision, self.residency, tier = made.high, made.residency, made.tier
        self.tier_bytes = made.tier_bytes  # what the low tier takes of the budget (low-tier mode)
        if copy_order not in COPY_ORDERS:
            raise MoetierError(f"unknown copy order {copy_order!r}", hint=f"one of {', '.join(COPY_ORDERS)}")
        # with no prefetcher nothing is ever held back, and the demand-first queue would only keep its count of the
        # stream's copies (two of the ~9 CUDA calls a copy made: bench/gpu/host_time.py): copies go in the order asked
        order = "fifo" if prefetch == "none" else copy_order
        self.host_tier, self._copy_order, self.copies = host_tier, COPY_ORDERS[order], None
        self.costs = RunningCosts(entry_bytes[self.precision])  # (before the pools: a copy queue reads it)
        self.pools = {p: self._slots(p, self.residency.slots(p)) for p in self.residency.entry_bytes}
        # how the host waits for a layer's routing: behind a host tier, letting held prefetch copies onto the link
        self._route_wait = None if self.copies is None else _RoutingWait(self.copies, self.pools)
        if tier is not None:
            self.pools[tier.low] = make_slots(manifest.precisions[tier.low], spec.num_expert_keys, self.device,
                                              manifest.linked(tier.low))
        self.expert_kernels = {p: make_expert_kernel(p, self.kernels, dtype, spec) for p in self.pools}
        self.counts = CountingHook(entry_bytes, self.precision if mixed.mixed else None)
        if substitution is not None:
            substitution = substitution.resolved(spec.num_expert_keys * spec.expert_params)
        prefetch_params = {"memory": device_memory(str(self.device)), **(prefetch_params or {})}  # (CoMoE's m_avail)
        stages = plan_stages(made, substitution, prefetch, predictor, self.costs, spec.top_k, prefetch_params,
                             placement)
        # the substitution stage, if any: its α is tuned at run time (--tpot-budget)
        self.substitution = next((s for s in stages if isinstance(s, SubstitutionStage)), None)
        self.layer_step = LayerStep(self.residency, Planner(self.precision, stages), hooks=[self.counts],
                                    predictor=predictor)
        self._clock = time.perf_counter()  # when the previous MoE layer's experts were done
        self._disk = reader.activity()  # (busy seconds, bytes) at that moment
        self.in_flight: dict[ExpertKey, tuple[str, int]] = {}  # prefetched keys whose reads may not have landed
        if tier is not None:
            self._fill(self.pools[tier.low], tier.low, tier.slot, f"low tier ({tier.low})")
        self.host_device = torch.device("cpu")
        self.host_pools: dict = {}  # precision -> every expert at it in host memory, when placement computes there
        self.host_kernels: dict = {}  # precision -> the host CPU's kernel for it
        # whether a layer may skip planning once every expert is resident (ResidentLayers): nothing plans but the
        # on-demand stage, one precision, no predictor
        self._plain = (len(stages) == 1 and isinstance(stages[0], OnDemandStage) and tier is None
                       and predictor is None and not mixed.mixed)
        self._resident: ResidentLayers | None = None  # made when first every expert is resident
        self.resident_layers: ResidentLayers | None = None  # this step's, or None: each layer is planned
        self._hit = HitLayer(self) if self._plain else None
        self.hit_layer: HitLayer | None = None  # this step's, or None: each layer is planned
        if placement != "none":
            # HOBBIT's low copies too: a missing expert its loader wants low is computed from one (§5.5.1's gains)
            host = mixed.host_precisions(native)
            self._host_index = {key: i for i, key in enumerate(spec.expert_keys())}
            for p in host:
                if host_tier is not None and host_tier.holds(p):  # every expert there already, at its index
                    self.host_pools[p] = host_tier.pools[p]
                    continue
                self.host_pools[p] = make_slots(manifest.precisions[p], spec.num_expert_keys, self.host_device,
                                                manifest.linked(p))
                self._fill(self.host_pools[p], p, self.host_slot, f"host tier ({p})")
            self.host_kernels = {p: make_expert_kernel(p, host_kernels or self.kernels, dtype, spec) for p in host}
            self._probe_host(dtype)

    def _slots(self, precision: str, num_slots: int):
        """The cache's slots of `precision`: fed from the host tier where there is one and it keeps that
        precision, else read straight into (through staging buffers on a GPU)."""
        if self.host_tier is not None and precision in self.host_tier.pools:
            if self.copies is None:  # one copy queue (and stream) for all of them
                self.copies = self._copy_order(self.device, self.costs)
            return TieredDeviceSlots(self.manifest.precisions[precision], num_slots, self.device, self.host_tier,
                                     precision, self.copies)
        return make_slots(self.manifest.precisions[precision], num_slots, self.device, self.manifest.linked(precision))

    @property
    def pool(self):
        """The cache's slots of the run's high precision (the model's own in exact mode)."""
        return self.pools[self.precision]

    @property
    def reserved_bytes(self) -> int:
        """Bytes the cache holds at most now: each cached precision's slots within its capacity (a cache that shrank
        gave the rest back), and the low tier's whole pool."""
        total = 0
        for precision, pool in self.pools.items():
            slots = self.residency.slots(precision) if precision in self.residency.entry_bytes else pool.num_slots
            total += pool.nbytes // max(1, pool.num_slots) * min(slots, pool.num_slots)
        return total

    @property
    def slots(self) -> int:
        """Experts of the run's high precision the cache holds at most now."""
        return min(self.residency.slots(self.precision), self.pool.num_slots)

    def _fill(self, pool, precision: str, slot_of, desc: str) -> None:
        """Read every expert's `precision` copy into `pool` at `slot_of(layer, expert)` (once, at start-up): a low
        tier, or the host tier."""
        from moetier.progress import tqdm

        keys = self.spec.expert_keys()
        for layer, e in keys:
            slot, blob = slot_of(layer, e), self.manifest.blob(layer, e, precision)
            self.reader.submit(blob, pool.read_target(slot, blob.phase, blob.layer), pool.completions[slot], ON_DEMAND)
        for layer, e in tqdm(keys, desc=desc, unit="expert", disable=None, leave=False):
            pool.completions[slot_of(layer, e)].wait()

    def host_slot(self, layer: int, expert: int) -> int:
        """An expert's slot in the host tier (its place among the model's experts, as in the low tier)."""
        return self._host_index[(layer, expert)]

    def _probe_host(self, dtype: torch.dtype) -> None:
        """What one host expert costs, measured once before any plan weighs it (later host computes refine it)."""
        w = self.host_pools[self.precision].weights(self.host_slot(*self.spec.expert_keys()[0]))
        kernel = self.host_kernels[self.precision]
        x = torch.zeros(1, self.spec.hidden_size, dtype=dtype)
        out, weights = torch.empty_like(x), torch.ones(1, dtype=dtype)
        kernel(out, x, w, weights)  # warm: first calls pay for allocation and dispatch
        start = time.perf_counter()
        kernel(out, x, w, weights)
        self.costs.observe_host(1, time.perf_counter() - start)

    def begin_step(self, phase: int, phases: tuple[PhaseCounters, PhaseCounters]) -> None:
        """A forward step starts; its layers are counted into `phases` (one generate call's statistics)."""
        self.layer_step.begin_step(phase)
        self.counts.phases = phases
        # whether a hook beside the counters needs plans (a trace recorder): then every layer is planned
        planned = any(h is not self.counts and h.needs_plans for h in self.layer_step.hooks)
        self.resident_layers = self._resident_step(planned)
        if self.resident_layers is not None:  # (its tables read every slot: a later copy into one waits for this step)
            for pool in self.pools.values():
                pool.read_all()
        # a layer whose experts all hit skips planning where a plan would change nothing and no hook needs one
        self.hit_layer = None if planned else self._hit

    def _resident_step(self, planned: bool) -> ResidentLayers | None:
        """ResidentLayers for this step when planning would change nothing: every expert resident (so no read, no
        eviction), nothing but on-demand planning, and no observer of plans but the counters (a trace recorder hears
        plans; one that hears routes alone, as --adapt's offload priority, is told them by ResidentLayers).
        `planned`: a hook needs plans."""
        if not self._plain or len(self.residency) < self.spec.num_expert_keys or self.in_flight or planned:
            self._resident = None  # (slots may move before every expert is resident again)
            return None
        if self._resident is None:
            self._resident = ResidentLayers(self)
        return self._resident

    def resident_tables(self):
        """One TokenTable a MoE layer while this step's layers are computed straight from their routing with every
        expert's table in hand (ResidentLayers), else None: the model may then run the whole step in one native
        call and tell each layer's route afterwards (`heard`)."""
        resident = self.resident_layers
        return None if resident is None else resident.tables

    def resident_on_device(self, tokens: int) -> ResidentLayers | None:
        """This step's resident layers where `tokens` tokens' experts are computed from the router's outputs with no
        read back to the host (`ResidentLayers.on_device`), else None: what a captured CUDA graph of the step needs
        (moetier/model/decode_graphs.py), which computes through `compute` and tells each route to `heard`."""
        resident = self.resident_layers
        return resident if resident is not None and resident.on_device(tokens) else None

    def heard(self, layer: int, scores: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """A layer the model routed and computed itself from `resident_tables`: heard as ResidentLayers hears one."""
        self.resident_layers.heard(layer, scores, topk_ids, topk_weights, self.layer_step.step, self.layer_step.phase)

    def __call__(self, layer: int, x: torch.Tensor, scores: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, shared: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, H], scores [T, E], topk_ids/topk_weights [T, k] -> routed (+ shared) expert output [T, H]."""
        if self.resident_layers is not None:
            return self.resident_layers(layer, x, scores, topk_ids, topk_weights, shared, self.layer_step.step,
                                        self.layer_step.phase)
        # The one host sync of the layer: which experts to read is decided on the host from the routing (and the
        # predictor's scores for the coming layers, computed beside the router, come back in the same copy).
        predictor = self.layer_step.predictor
        ahead = None if predictor is None else predictor.on_device(layer, x)
        arrays, values = route_arrays_with(topk_ids, topk_weights, scores, ahead, self._route_wait)
        if values is not None:
            predictor.read_back(layer, values)
        route = RouteResult(layer, self.layer_step.step, *arrays, self.layer_step.phase)
        if layer != self.spec.moe_layers[0]:  # (the first one's gap holds the previous step's head too)
            self.costs.observe_dense(time.perf_counter() - self._clock)
        self._poll_landed()
        out = None if self.hit_layer is None else self.hit_layer(route, x, topk_weights.dtype, shared)
        if out is None:
            plan = self.layer_step.begin(route, x)
            out = self.carry_out(plan, x, topk_weights.dtype, shared)
            for prefetch in self.layer_step.end(plan):
                self._prefetch(prefetch)
        self._observe_link()
        self._clock = time.perf_counter()
        return out

    def carry_out(self, plan: LayerPlan, x: torch.Tensor, weight_dtype: torch.dtype,
                  shared: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """Compute `plan` (its assignment, runs, loads and prefetches) on `x`: the output [T, H]."""
        layer = plan.layer
        for key in plan.cancels:  # prefetches this layer proved wrong: give the link back if they never started
            precision, slot = self.in_flight.get(key, (None, None))
            if slot is not None and self.pools[precision].cancel(self.reader, slot):
                del self.in_flight[key]
                self.residency.drop(key)
                plan.cancelled.append((key, precision))
        for run in plan.runs:  # prefetches this layer needs, still reading: on-demand now, ahead of its loads
            if run.source == IN_FLIGHT:
                self.pools[run.precision].promote(self.reader, run.slot)
        deferred: dict[int, Load] = {}
        for load in plan.loads:  # on-demand reads first, before any compute, so they overlap it
            if load.after is None:
                self._submit(ExpertKey(layer, load.expert), load.precision, load.slot, ON_DEMAND)
            else:
                deferred[load.after] = load
        for prefetch in plan.prefetches:
            self._prefetch(prefetch)
        order = plan.one_token_order()
        if order is not None:  # one token whose experts are all resident: the kernels' one-token call
            groups, counts = OneToken(x, plan.assign_weights[0][order], weight_dtype, self.kernels.combine), None
        else:
            counts = plan.counts  # [E]
            groups = ExpertGroups(x, plan.assign_ids, plan.assign_weights, counts, weight_dtype, self.kernels.combine)
        # resident runs by precision (and a device's loads whose copies are queued: `_copy_queued`), computed a
        # precision a call before the next run that waits for a read
        together: dict[str, list[Run]] = {}
        landed: dict[str, list[Run]] = {}  # loaded runs a device computes after its copies, a precision a call
        hosted: dict[str, list[Run]] = {}  # runs on the host CPU from the host tier, a precision a call
        if plan.hosts:
            groups.send(self.host_device)  # (their tokens on their way to the host before the device's work)
        try:
            shared_out = shared() if shared is not None else None  # resident work first, while reads land
            for run in plan.runs:
                if run.place == HOST:  # where its weights live: the host tier, on the host CPU
                    hosted.setdefault(run.precision, []).append(run)
                    continue
                pool = self.pools[run.precision]
                if run.expert not in deferred and (run.source == RESIDENT or self._copy_queued(pool, run, layer)):
                    together.setdefault(run.precision, []).append(run)
                    continue
                self._compute_together(groups, together)
                self._compute_hosted(groups, hosted, counts, layer)  # (the device computes the above meanwhile)
                if run.source != RESIDENT:
                    self._arrived(pool, run, layer)
                    if pool.waits_on_device and run.expert not in deferred:  # (its copy: ordered on the device)
                        landed.setdefault(run.precision, []).append(run)
                        continue
                w = pool.weights(run.slot)
                start = time.perf_counter()
                groups.compute(run.expert, self.expert_kernels[run.precision], w)
                pool.queued()  # (a copy into the slot waits for this compute, not for the layer's later ones)
                self.costs.observe_expert(time.perf_counter() - start)
                follower = deferred.pop(run.expert, None)
                if follower is not None:  # its slot is free now
                    self._submit(ExpertKey(layer, follower.expert), follower.precision, follower.slot, ON_DEMAND)
            self._compute_together(groups, together)
            self._compute_hosted(groups, hosted, counts, layer)
            self._compute_together(groups, landed)
        except BaseException:
            self._abandon(plan)
            raise
        out = groups.combine()
        return out + shared_out if shared_out is not None else out

    def _copy_queued(self, pool, run: Run, layer: int) -> bool:
        """A loaded run a device orders after its copy, the copy already queued (from the host tier: a GPU's host
        never waits for it): it joins its precision's resident runs in one call — one launch pair a precision a layer,
        not two. The device starts it once the layer's copies are in, so the resident experts no longer compute while
        copies land: on the H200 a copy took ~0.25 ms and a layer's experts ~0.03, while the host, which sets the step
        below a whole-model budget, pays a launch pair's table, copy and launches each call (docs/gpu.md). A read
        still on its way from the disk keeps the resident runs' call ahead of the host's wait for it."""
        if not pool.waits_on_device or run.source == RESIDENT or not pool.completions[run.slot].done.is_set():
            return False
        self._arrived(pool, run, layer)  # (done: no wait)
        return True

    def _arrived(self, pool, run: Run, layer: int) -> None:
        """A loaded run's read waited for (a failed one's error raised here), and a prefetch this layer needed no
        longer in flight."""
        pool.completions[run.slot].wait()
        self.in_flight.pop(ExpertKey(layer, run.expert), None)

    def _compute_together(self, groups: ExpertGroups | OneToken, together: dict[str, list[Run]]) -> None:
        """Resident experts whose slots no load waits for, or a device's loaded ones (the device orders each after
        its copy; a GPU's host never waits for one, so one launch for them all costs no overlap): each precision's in
        one kernel call (one parallel region for the layer's experts at batch 1, one launch pair on a GPU — not
        one an expert); `together` is emptied."""
        for precision, runs in together.items():
            pool = self.pools[precision]
            start = time.perf_counter()
            groups.compute_layer([run.expert for run in runs], self.expert_kernels[precision],
                                 pool.weights_for([run.slot for run in runs]))
            pool.queued()
            each = (time.perf_counter() - start) / len(runs)
            for _ in runs:
                self.costs.observe_expert(each)
        together.clear()

    def _compute_hosted(self, groups: ExpertGroups, hosted: dict[str, list[Run]], counts, layer: int) -> None:
        """The runs placed on the host: each precision's in one call of the host's kernel on the host tier's
        weights (one parallel region), their outputs copied back to the device; `hosted` is emptied."""
        for precision, runs in hosted.items():
            pool = self.host_pools[precision]
            start = time.perf_counter()
            groups.compute_layer_on([run.expert for run in runs], self.host_kernels[precision],
                                    [pool.weights(self.host_slot(layer, run.expert)) for run in runs],
                                    self.host_device)
            each = (time.perf_counter() - start) / len(runs)
            for run in runs:
                self.costs.observe_host(int(counts[run.expert]), each)
        hosted.clear()

    def _submit(self, key: ExpertKey, precision: str, slot: int, priority: int) -> None:
        self.pools[precision].submit(self.reader, key, self.manifest.blob(key.layer, key.expert, precision), slot,
                                     priority)

    def _prefetch(self, prefetch: Prefetch) -> None:
        self._submit(prefetch.key, prefetch.precision, prefetch.slot, PREFETCH)
        self.in_flight[prefetch.key] = (prefetch.precision, prefetch.slot)

    def _observe_link(self) -> None:
        """What loads cost since the last layer, for the stages that weigh time: the disk's busy time and bytes (the
        reader's); through a host tier, the bytes copied to the device over the copies' time and the disk's (a load
        found in host memory is one copy, one read from disk a read and a copy)."""
        busy, nbytes = self.reader.activity()
        disk_s, disk_bytes = busy - self._disk[0], nbytes - self._disk[1]
        self._disk = (busy, nbytes)
        copied, copy_s = 0, 0.0
        for pool in self.pools.values():
            b, s = pool.link_activity()
            copied, copy_s = copied + b, copy_s + s
        if copied:
            self.costs.observe_read(copied, disk_s + copy_s)
        else:
            self.costs.observe_read(disk_bytes, disk_s)

    def _poll_landed(self) -> None:
        """Prefetches whose reads have finished are resident (a failed one is forgotten)."""
        for key, (precision, slot) in list(self.in_flight.items()):
            pool = self.pools[precision]
            completion = pool.completions[slot]
            if completion.done.is_set():
                del self.in_flight[key]
                if completion.error is None:
                    self.residency.landed(key)
                    pool.landed(slot)  # (a device pool queues its copy now, not when the expert is first used)
                else:
                    self.residency.drop(key)

    def resize(self, capacity_bytes: int, order=None) -> list[ExpertKey]:
        """The cache's new size (the whole budget, the low tier's part included), between steps. The reads in flight
        land first (a running read is never interrupted) and prefetched experts become plain entries; shrinking then
        evicts by the policy (or by `order`: Residency.resize's) and hands the freed slots' pages back to the system,
        growing adds slots that fill as experts are needed. Returns the evicted keys."""
        for precision, slot in list(self.in_flight.values()):
            self.pools[precision].promote(self.reader, slot)  # (a copy held on the host is queued now)
            self.pools[precision].completions[slot].done.wait()
        self._poll_landed()
        self.residency.unpin_all(PREFETCHED)
        evicted = self.residency.resize(capacity_bytes - self.tier_bytes, order)
        for precision in self.residency.entry_bytes:
            pool = self.pools[precision]
            pool.ensure(max(pool.num_slots, self.residency.slots(precision)))
            used = {e.slot for e in self.residency.entries.values() if e.precision == precision}
            pool.release(s for s in range(pool.num_slots) if s not in used)
        self._resident = None  # (its tables are of slots that may have gone)
        return evicted

    def close(self) -> None:
        """The cache's memory handed back now (the engine is closing, or moving to a variant): its slots', and the
        host pools it made for placement (a host tier's are the tier's own)."""
        shared = set(map(id, self.host_tier.pools.values())) if self.host_tier is not None else set()
        for pool in [*self.pools.values(), *self.host_pools.values()]:
            if id(pool) not in shared:
                pool.close()

    def preload(self, keys: Iterable[ExpertKey] | None = None) -> int:
        """Load experts (by default every expert, layer by layer) into free room until the cache is full: a warm
        start, and with a budget of 100% the whole model resident. Returns how many were loaded."""
        if keys is None:
            keys = (ExpertKey(layer, e) for layer, e in self.spec.expert_keys())
        admitted = self.residency.admit_while_room(keys, self.precision)
        errors = []
        try:
            for key, slot in admitted:
                self._submit(key, self.precision, slot, ON_DEMAND)
        finally:
            for key, slot in admitted:
                try:
                    self.pool.completions[slot].wait()
                    self.residency.landed(key)
                except MoetierError as e:
                    errors.append(e)
                    self.residency.drop(key)
            self.residency.unpin_all()
        if errors:
            raise errors[0]
        return len(admitted)

    def _abandon(self, plan: LayerPlan) -> None:
        """After a failed read: let reads in flight finish, and forget every expert this layer was loading, since
        its slot may hold anything."""
        for load in plan.loads:
            self.pools[load.precision].completions[load.slot].done.wait()
            self.residency.drop(ExpertKey(plan.layer, load.expert))
        self.residency.unpin_all()


class _RoutingWait:
    """How the host waits for a layer's routing behind a host tier: the copy queue's wait (held prefetch copies let
    onto the link meanwhile), then the pools told the compute stream's work so far is done — a copy waits for none
    of it, and a reused mark is not synchronized again (SlotReads.device_done). (Its own object, not a bound method
    of the executor: that would be a cycle through the executor's slots.)"""

    def __init__(self, copies, pools: dict) -> None:
        self.copies, self.pools = copies, pools

    def __call__(self) -> None:
        self.copies.wait_current()
        for pool in self.pools.values():
            pool.device_done()
