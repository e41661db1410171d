"""The on-demand stage: every needed expert gets a run; one not in the cache also gets a slot and a load.

An expert resident at another precision than wanted runs at the precision it is held at (HOBBIT: a resident copy
of any precision is used); one an earlier stage already gave a run (a resident low tier) is left to it. If the budget is smaller than the experts one layer needs, a load takes the slot
of an expert this layer computes earlier (chosen by the eviction policy) and waits for that compute: experts
stream through the cache, so any budget of one layer's top-k is correct, only slower. A missing expert a
placement stage put on the HOST gets a run there (no slot, no read), after the resident ones and before those
waiting for reads."""

from __future__ import annotations

from moetier.cache.keys import ExpertKey
from moetier.cache.residency import IN_USE, Residency
from moetier.plan.layer_plan import HOST, IN_FLIGHT, IN_PLACE, LOAD, RESIDENT, LayerPlan, Load, Run


class OnDemandStage:
    name = "on-demand"

    def __init__(self, residency: Residency) -> None:
        self.residency = residency

    def __call__(self, plan: LayerPlan) -> LayerPlan:
        r, layer = self.residency, plan.layer
        resident, in_place, in_flight, misses = [], [], [], []
        planned = {run.expert for run in plan.runs}  # run from elsewhere by an earlier stage (a low tier)
        for e in plan.experts:
            if e in planned:
                continue
            key = ExpertKey(layer, e)
            entry = r.entries.get(key)
            if entry is None:
                if plan.place[e] == HOST:
                    in_place.append(Run(e, plan.precision[e], -1, IN_PLACE, HOST))
                else:
                    misses.append(e)
                continue
            r.pin(key, IN_USE)
            plan.precision[e] = entry.precision
            run = Run(e, entry.precision, entry.slot, IN_FLIGHT if entry.loading else RESIDENT, plan.place[e])
            (in_flight if entry.loading else resident).append(run)
        plan.runs += resident + in_place + in_flight  # resident work first, while reads land
        done_before = {key: None for key in (ExpertKey(layer, run.expert) for run in plan.runs)
                       if key in r.entries}  # cached, computed earlier, in order
        for e in misses:
            key, precision = ExpertKey(layer, e), plan.precision[e]
            got = r.admit(key, precision, IN_USE)
            if got is not None:
                (slot, evicted), after = got, None
            else:
                same = {k: None for k in done_before if r.entries[k].precision == precision}
                slot, victim = r.replace(key, precision, same)
                del done_before[victim]
                evicted, after = (victim,), victim.expert
            plan.loads.append(Load(e, precision, slot, after, evicted))
            plan.runs.append(Run(e, precision, slot, LOAD, plan.place[e]))
            done_before[key] = None
        return plan
