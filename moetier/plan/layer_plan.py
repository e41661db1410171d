"""What to do for one MoE layer: every decision, so that an executor computes from the plan alone.

- the assignment: per (token, k), the expert that runs — the routed one, a substitute, or SKIP — and its weight;
- per needed expert (each expert the assignment names), in compute order: its precision, where it runs, the
  slot its weights are in, and how they get there (already resident, a read in flight since an earlier layer, or
  a load of this plan);
- the loads this plan issues, each into a slot, some waiting for an expert of this layer to be computed before
  they overwrite its slot;
- the prefetches to start once the loads are out: reads of experts a later layer is expected to need, and the
  prefetches aimed at this layer that it proved wrong (reads to cancel if they have not started);
- what the predictor said of the coming layers, and how the prefetches aimed at this layer turned out.

Exact mode is the plan whose assignment equals the routing."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moetier.cache.keys import ExpertKey, Precision
from moetier.plan.route import RouteResult

SKIP = -1  # an assignment that runs no expert (its weight is dropped)
RESIDENT, IN_FLIGHT, LOAD = "resident", "in-flight", "load"  # how a run's weights get to its slot
IN_PLACE = "in-place"  # a HOST run's: computed where its weights live, no slot and no read
FAST, HOST = "fast", "host"  # where an expert runs: on the compute device from the cache, or where its weights live


@dataclass(frozen=True)
class Load:
    expert: int
    precision: Precision
    slot: int
    after: int | None = None  # an expert of this layer whose compute must finish before the slot is overwritten
    evicted: tuple[ExpertKey, ...] = ()  # who left to make room


@dataclass(frozen=True)
class Prefetch:
    key: ExpertKey  # an expert of a later layer (or a later step)
    precision: Precision
    slot: int
    evicted: tuple[ExpertKey, ...] = ()


@dataclass(frozen=True)
class Run:
    """One needed expert: computed once for every (token, k) the assignment gives it."""

    expert: int
    precision: Precision
    slot: int  # in its precision's pool (-1 for a HOST run)
    source: str  # RESIDENT, IN_FLIGHT (wait for a read an earlier layer started), LOAD (this plan's load) or
    # IN_PLACE (a HOST run)
    place: str = FAST


@dataclass
class LayerPlan:
    route: RouteResult
    assign_ids: np.ndarray  # [T, k] int64: the expert each (token, k) runs, or SKIP
    assign_weights: np.ndarray  # [T, k] float32
    precision: dict[int, Precision]  # per needed expert, ascending: the precision it is wanted at
    place: dict[int, str]  # per needed expert: FAST or HOST
    runs: list[Run] = field(default_factory=list)  # in compute order
    loads: list[Load] = field(default_factory=list)  # in issue order
    prefetches: list[Prefetch] = field(default_factory=list)
    predictions: dict[int, np.ndarray] = field(default_factory=dict)  # coming MoE layer -> scores [T, E]
    cancels: list[ExpertKey] = field(default_factory=list)  # prefetched for this layer, not needed, still reading
    cancelled: list[tuple[ExpertKey, Precision]] = field(default_factory=list)  # of those, what the executor
    # cancelled before its read started
    prefetch_used: int = 0  # prefetched for this layer, needed, landed in time (hits)
    prefetch_late: int = 0  # prefetched for this layer, needed, still reading when the layer needed it
    prefetch_wasted: int = 0  # prefetched for this layer and not needed by it

    @classmethod
    def exact(cls, route: RouteResult, precision: Precision) -> LayerPlan:
        """The assignment the router made, every needed expert at `precision`, computed where the cache is."""
        plan = cls(route, route.topk_ids, route.topk_weights, {}, {})
        plan.reassign(route.topk_ids, route.topk_weights, precision)
        return plan

    def reassign(self, ids: np.ndarray, weights: np.ndarray, precision: Precision) -> None:
        """A new assignment (a substitution stage's); experts it adds are wanted at `precision`, on FAST."""
        self.assign_ids, self.assign_weights = ids, weights
        needed = sorted(set(ids.ravel().tolist()) - {SKIP})  # ascending (a set: 0.6 us on decode's few, np.unique 3.5)
        self.precision = {e: self.precision.get(e, precision) for e in needed}
        self.place = {e: self.place.get(e, FAST) for e in needed}

    @property
    def layer(self) -> int:
        return self.route.layer

    @property
    def experts(self) -> list[int]:
        """Distinct experts the assignment runs, ascending."""
        return list(self.precision)

    @property
    def counts(self) -> np.ndarray:
        """[E] (token, k) pairs assigned to each expert."""
        ids = self.assign_ids[self.assign_ids != SKIP]
        return np.bincount(ids, minlength=self.route.scores.shape[-1])

    @property
    def hosts(self) -> bool:
        """Whether some run is placed on the host CPU."""
        return HOST in self.place.values()

    def one_token_order(self) -> np.ndarray | None:
        """For one token whose experts are all resident at one precision, each expert one pair of the assignment
        (none skipped, none twice) and the runs in ascending ids: the pairs' order by expert id, the runs' order
        (the executor then computes them in the kernel's one-token call). Else None."""
        runs, ids = self.runs, self.assign_ids
        if ids.shape[0] != 1 or len(runs) != ids.shape[1]:  # (fewer runs than pairs: a pair skipped, or shared)
            return None
        precision = runs[0].precision
        if any(run.source != RESIDENT or run.precision != precision for run in runs):
            return None
        order = np.argsort(ids[0], kind="stable")  # [k]
        if [run.expert for run in runs] != ids[0][order].tolist():
            return None
        return order

    @property
    def hits(self) -> list[Run]:
        """Runs whose weights were resident when the layer needed them."""
        return [r for r in self.runs if r.source == RESIDENT]
