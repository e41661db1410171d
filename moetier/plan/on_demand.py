"""The on-demand stage: every needed expert that is not resident gets a slot and a load.

If the budget is smaller than the experts one layer needs, a load takes the slot of an expert this layer
computes earlier (chosen by the eviction policy) and waits for that compute: experts stream through the
cache, so any budget of at least one slot is correct, only slower."""

from __future__ import annotations

from moetier.cache.keys import ExpertKey
from moetier.cache.residency import Residency
from moetier.plan.layer_plan import Hit, LayerPlan, Load


class OnDemandStage:
    name = "on-demand"

    def __init__(self, residency: Residency) -> None:
        self.residency = residency

    def __call__(self, plan: LayerPlan) -> LayerPlan:
        r, layer = self.residency, plan.layer
        misses = []
        for e in plan.experts:
            key = ExpertKey(layer, e)
            if key in r:
                r.pin(key)
                plan.hits.append(Hit(e, r.slot_of[key]))
            else:
                misses.append(e)
        done_before = {ExpertKey(layer, h.expert): None for h in plan.hits}  # computed earlier, in compute order
        for e in misses:
            key = ExpertKey(layer, e)
            got = r.admit(key)
            if got is not None:
                slot, evicted = got
                after = None
            else:
                slot, evicted = r.replace(key, done_before)
                del done_before[evicted]
                after = evicted.expert
            plan.loads.append(Load(e, slot, after, evicted))
            done_before[key] = None
        return plan
