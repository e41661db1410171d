"""The real executor for routed experts: plans a layer, issues its loads, computes what is resident while the
loads land, then the rest as each arrives."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from moetier.cache.keys import ExpertKey
from moetier.cache.policies.base import EvictionPolicy
from moetier.cache.residency import Residency
from moetier.cache.slots import SlotPool
from moetier.config import ModelSpec
from moetier.engine.grouping import ExpertGroups
from moetier.engine.stats import PREFILL, GenerationStats
from moetier.errors import MoetierError
from moetier.plan.layer_plan import LayerPlan, Load
from moetier.plan.on_demand import OnDemandStage
from moetier.plan.planner import Planner
from moetier.plan.route import RouteResult
from moetier.store.format import Manifest
from moetier.store.reader import ON_DEMAND, ExpertReader


class ExpertExecutor:
    def __init__(self, spec: ModelSpec, manifest: Manifest, num_slots: int, policy: EvictionPolicy,
                 reader: ExpertReader, per_layer: bool = False) -> None:
        self.spec, self.manifest, self.reader, self.policy = spec, manifest, reader, policy
        self.precision = manifest.native_precision
        self.pool = SlotPool(manifest.precisions[self.precision], num_slots)
        self.residency = Residency(num_slots, policy, spec.moe_layers if per_layer else None)
        self.planner = Planner(spec.num_experts, [OnDemandStage(self.residency)])
        self.stats = GenerationStats()
        self.phase = PREFILL
        self.step = 0
        # observer of every layer's routing and gate input (the trace recorder, evaluation)
        self.on_route: Callable[[RouteResult, torch.Tensor], None] | None = None

    def begin_step(self, phase: int, stats: GenerationStats) -> None:
        self.phase, self.stats = phase, stats
        self.step += 1

    def _submit(self, layer: int, load: Load) -> None:
        blob = self.manifest.blob(layer, load.expert, self.precision)
        self.reader.submit(blob, self.pool.views[load.slot], self.pool.completions[load.slot], ON_DEMAND)

    def __call__(self, layer: int, x: torch.Tensor, scores: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, shared: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, H], scores [T, E], topk_ids/topk_weights [T, k] -> routed (+ shared) expert output [T, H]."""
        # The one host sync of the layer: which experts to read is decided on the host from the routing.
        route = RouteResult(layer, self.step, topk_ids.numpy(), topk_weights.float().numpy(), scores.numpy())
        if self.on_route is not None:
            self.on_route(route, x)
        self.policy.on_route(route)
        plan = self.planner.plan(route)
        deferred = {}
        for load in plan.loads:  # issue loads before any compute, so reads overlap it
            if load.after is None:
                self._submit(layer, load)
            else:
                deferred[load.after] = load

        groups = ExpertGroups(x, topk_ids, topk_weights, plan.counts)

        def compute(expert: int, slot: int) -> None:
            w = self.pool.tensors[slot]
            groups.compute(expert, w["gate_up_proj"], w["down_proj"])
            follower = deferred.pop(expert, None)
            if follower is not None:  # its slot is free now
                self._submit(layer, follower)

        try:
            shared_out = shared() if shared is not None else None  # resident work first, while loads land
            for hit in plan.hits:
                compute(hit.expert, hit.slot)
            for load in plan.loads:
                self.pool.completions[load.slot].wait()
                compute(load.expert, load.slot)
        except BaseException:
            self._abandon(layer, plan)
            raise

        out = groups.combine()
        if shared_out is not None:
            out = out + shared_out
        for e in plan.experts:
            self.policy.on_access(ExpertKey(layer, e), self.precision, self.step)
        self.residency.unpin_all()
        blob_bytes = self.pool.slot_bytes
        self.stats.record_layer(self.phase, len(plan.experts), len(plan.hits), len(plan.loads),
                                len(plan.loads) * blob_bytes)
        return out

    def preload(self, keys: Iterable[ExpertKey] | None = None) -> int:
        """Load experts (by default every expert, layer by layer) into free slots until the cache is full: a warm
        start, and with a budget of 100% the whole model resident. Returns how many were loaded."""
        if keys is None:
            keys = (ExpertKey(layer, e) for layer in self.spec.moe_layers for e in range(self.spec.num_experts))
        in_flight: list[tuple[ExpertKey, int]] = []
        try:
            for key in keys:
                if key in self.residency:
                    continue
                if self.residency.free_slots == 0:
                    break
                if not self.residency.has_room(key.layer):  # a per-layer cache whose share for it is full
                    continue
                slot, _ = self.residency.admit(key)
                self._submit(key.layer, Load(key.expert, slot))
                in_flight.append((key, slot))
        finally:
            errors = []
            for key, slot in in_flight:
                try:
                    self.pool.completions[slot].wait()
                except MoetierError as e:
                    errors.append(e)
                    self.residency.drop(key)
            self.residency.unpin_all()
        if errors:
            raise errors[0]
        return len(in_flight)

    def _abandon(self, layer: int, plan: LayerPlan) -> None:
        """After a failed load: let reads in flight finish, and forget every expert this layer was loading,
        since its slot may hold anything."""
        for load in plan.loads:
            self.pool.completions[load.slot].done.wait()
            self.residency.drop(ExpertKey(layer, load.expert))
        self.residency.unpin_all()
