"""Prefetch stages: after the on-demand stage, name reads of experts the coming layers are predicted to need.

The bookkeeping is shared (`PrefetchStage`); a subclass only chooses which experts, in the order to read them.

- A prefetched expert is pinned (PREFETCHED) from its admission until the layer it was read for routes. That
  layer settles it: needed and landed → used (a hit); needed and still reading → late (a miss that waits less);
  not needed → wasted: unpinned, and its read cancelled if it has not started (a running read is never
  interrupted).
- A predicted expert already resident is pinned the same way (HOBBIT §3.3 masks predicted experts from eviction)
  but is no prefetch: it reads nothing.
- Prefetch pins never crowd out the coming layer's own misses: in each cache scope (the whole cache, or a layer's
  share), `reserve` entries — one per (token, k), at most every expert — stay free of them.
- A prefetch never evicts what the layers still to run in this step used in the previous one. In a cache shared
  by the layers those are exactly the least recent entries, so recency-based victims would be the hits about to
  come; where the cache holds about one step's experts, each such eviction cascades (the miss it causes evicts
  the next layer's, and so on: in the simulator Mixtral on an A100 at 25% fell from 51% hits to 0.4%).
- Under HOBBIT's loader (`loader`, its precision stage), a predicted expert is read at the precision that loader
  would choose from the predicted scores (§3.3, Fig. 9d–e: a wrong low-precision prefetch costs a quarter of the
  link), and not at all where it would skip it; a precision the cache does not hold (the low tier's, resident
  already) is not read either.
- Reads go out after the layer's on-demand loads, at the reader's lower priority: a prefetch never delays an
  on-demand read already queued, and queued on-demand reads of later layers overtake it."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.residency import PREFETCHED, Residency
from moetier.plan.layer_plan import IN_FLIGHT, RESIDENT, LayerPlan, Prefetch


def predicted_ids(scores: np.ndarray, top_k: int) -> list[int]:
    """[T, E] -> the experts in some token's predicted top-k, by summed score over the tokens, best first."""
    tokens, num_experts = scores.shape
    k = min(top_k, num_experts)
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]  # [T, k], unordered
    ids = np.unique(top)
    return ids[np.argsort(-scores[:, ids].sum(axis=0), kind="stable")].tolist()


class _WorkingSetAhead:
    """The experts the layers still to run in this step needed in the previous step: the working set about to be
    hit again, which a prefetch must not push out."""

    def __init__(self, layer: int, recent: dict[int, frozenset[int]]) -> None:
        self.layer, self.recent = layer, recent

    def __call__(self, key: ExpertKey) -> bool:
        return key.layer > self.layer and key.expert in self.recent.get(key.layer, ())


class PrefetchStage:
    name = "prefetch"
    loader = None  # a moetier.plan.precision.PrecisionStage: read each expert at the precision it would choose

    def __init__(self, residency: Residency, precision: Precision) -> None:
        self.residency, self.precision = residency, precision
        self.pinned: dict[ExpertKey, bool] = {}  # pinned for a coming layer -> whether we read it (a prefetch)
        self.recent: dict[int, frozenset[int]] = {}  # layer -> the experts it needed when it last ran
        self.at: dict[ExpertKey, Precision | None] = {}  # this layer's predicted experts -> the loader's precision

    def __call__(self, plan: LayerPlan) -> LayerPlan:
        self.settle(plan)
        self.recent[plan.layer] = frozenset(plan.experts)
        if plan.predictions:
            if self.loader is not None:
                self.at = self.loader_precisions(plan)
            self.issue(plan, self.select(plan))
        return plan

    def loader_precisions(self, plan: LayerPlan) -> dict[ExpertKey, Precision | None]:
        """Each predicted expert of the coming layers -> the precision the loader would read it at (None: none)."""
        k = plan.route.topk_ids.shape[1]
        return {ExpertKey(layer, e): precision for layer, scores in plan.predictions.items()
                for e, precision in self.loader.predicted(scores, k).items()}

    def precision_of(self, key: ExpertKey) -> Precision | None:
        """The precision to read `key` at: the loader's where there is one (None: not read), else the stage's."""
        if self.loader is None:
            return self.precision
        precision = self.at.get(key, self.precision)  # an expert outside the predicted top-k: as the stage says
        return precision if precision in self.residency.entry_bytes else None

    def select(self, plan: LayerPlan) -> Iterable[ExpertKey]:
        """The experts of coming layers to hold, in the order to read them (reading stops at the first that
        does not fit)."""
        raise NotImplementedError

    # -- shared bookkeeping ------------------------------------------------------------------------------------

    def settle(self, plan: LayerPlan) -> None:
        """The prefetches and masks aimed at this layer: count them, release what the routing proved wrong."""
        mine = [key for key in self.pinned if key.layer == plan.layer]  # a few layers' top-k at most
        if not mine:
            return
        sources = {run.expert: run.source for run in plan.runs}
        for key in mine:
            read = self.pinned.pop(key)
            source = sources.get(key.expert)
            if source is None:  # not needed (the on-demand stage pinned the needed ones for use)
                self.residency.unpin(key, PREFETCHED)
                if read:
                    plan.prefetch_wasted += 1
                    if self.residency.loading(key):
                        plan.cancels.append(key)
            elif read:
                if source == RESIDENT:
                    plan.prefetch_used += 1
                elif source == IN_FLIGHT:
                    plan.prefetch_late += 1
                else:  # its read failed or was given up, and it is loaded again
                    plan.prefetch_wasted += 1

    def issue(self, plan: LayerPlan, keys: Iterable[ExpertKey]) -> None:
        r = self.residency
        reserve = min(plan.route.scores.shape[1], plan.route.topk_ids.size)  # entries, at the precision in question
        spare = _WorkingSetAhead(plan.layer, self.recent)
        among = None  # the keys a prefetch may evict: listed once, on the first admission that needs them
        # (only where they may be few enough for admit to pick among them: at batch 1 they are most of the cache,
        # and listing them took more of a layer's host time than the rest of the stage)
        ahead = sum(len(experts) for layer, experts in self.recent.items() if layer > plan.layer)  # spared at most
        pinned: dict = {}  # each scope's bytes pinned for prefetches: summed once, then kept as this call pins
        for key in keys:
            if key in self.pinned or key.layer == plan.layer:
                continue
            entry = r.entries.get(key)
            if entry is not None:
                if entry.pin is None and self._room(key, entry.nbytes, reserve, entry.precision, pinned):
                    r.pin(key, PREFETCHED)
                    self.pinned[key] = False
                continue
            precision = self.precision_of(key)
            if precision is None:
                continue  # the loader would skip it, or run it from the resident low tier
            nbytes = r.entry_bytes[precision]
            if not self._room(key, nbytes, reserve, precision, pinned):
                break
            if among is None and 4 * (r.evictable - ahead) < len(r.entries) and not r.has_room(key.layer, nbytes,
                                                                                                precision):
                among = {k for k, e in r.entries.items() if not e.held and not spare(k)}
            got = r.admit(key, precision, PREFETCHED, spare=spare, among=among)
            if got is None:
                break
            slot, evicted = got
            plan.prefetches.append(Prefetch(key, precision, slot, evicted))
            self.pinned[key] = True

    def _room(self, key: ExpertKey, nbytes: int, reserve: int, precision: Precision, pinned: dict) -> bool:
        """Pinning `nbytes` more for `key` still leaves `reserve` entries at `precision` of its scope unpinned by
        prefetches; if so, those bytes are counted into `pinned` (scope -> bytes pinned for prefetches, summed on
        first look: the caller pins them next)."""
        r = self.residency
        part = r.part_of(key, precision)
        if part not in pinned:
            pinned[part] = r.pinned_bytes(PREFETCHED, part)
        if pinned[part] + nbytes + reserve * r.entry_bytes[precision] > r.part_capacity(part):
            return False
        pinned[part] += nbytes
        return True

    def reading(self) -> int:
        """Prefetches of ours whose reads have not landed."""
        return sum(1 for key, read in self.pinned.items() if read and self.residency.loading(key))
