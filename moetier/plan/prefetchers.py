"""The published prefetch rules, each a `PrefetchStage` that only chooses (the bookkeeping is shared):

- `hobbit`   HOBBIT §3.3 (Fig. 8): the predicted top-k of the next layer; if every one is cached, look one layer
             further, up to the predictor's distance p; every predicted expert is masked from eviction.
- `smoe`     SMoE §IV-C: only the next layer's top-score experts — predicted score at least (1+α)·S_{k+1}, with
             S_{k+1} the token's (k+1)-th score (the bound of its Alg. 1).
- `comoe`    CoMoE Eq. 19: every next-layer expert whose predicted probability exceeds
             θ_pre(t) = θ_base · S_b(t) · (1 + δ · free/total memory).
- `comoe-37` CoMoE Eq. 37, the same with θ_pre = γ · free/total memory (γ = θ_base).
- `presched` PreScope §4.3 (Alg. 1, Eq. 4, 6–7): as many of the next layer's predicted experts in the GPU queue
             as fit in the gap this layer leaves the link, f = (T_gap + t_attn) / t_io, the fractional "critical"
             one kept only when its expected gain beats its expected loss; when the queue holds none of the next
             layer's (batch 1 with a CPU lane), a larger window (Q4).
- `ahead`    ours: the predicted top-k of every coming layer up to p, nearest first (keeps reads queued)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.residency import Residency
from moetier.errors import MoetierError
from moetier.plan.costs import RunningCosts
from moetier.plan.device_memory import DeviceMemory, FixedMemory
from moetier.plan.layer_plan import HOST, IN_FLIGHT, LOAD, LayerPlan
from moetier.plan.on_demand import OnDemandStage
from moetier.plan.placement import gpu_queue, predicted_misses
from moetier.plan.prefetch import PrefetchStage, predicted_ids


class HobbitPrefetch(PrefetchStage):
    name = "hobbit"

    def select(self, plan: LayerPlan) -> Iterable[ExpertKey]:
        k = plan.route.topk_ids.shape[1]
        for layer in sorted(plan.predictions):  # nearest first, up to the predictor's distance p
            keys = [ExpertKey(layer, e) for e in predicted_ids(plan.predictions[layer], k)]
            yield from keys
            if any(key not in self.residency for key in keys):
                return  # something to read here: look no further


class AheadPrefetch(PrefetchStage):
    """Ours: the predicted top-k of every coming layer up to the predictor's distance, nearest layer first, so the
    link always has the next predicted reads queued (HOBBIT looks further only past fully cached layers)."""

    name = "ahead"

    def select(self, plan: LayerPlan) -> Iterable[ExpertKey]:
        k = plan.route.topk_ids.shape[1]
        for layer in sorted(plan.predictions):
            yield from (ExpertKey(layer, e) for e in predicted_ids(plan.predictions[layer], k))


class SmoePrefetch(PrefetchStage):
    name = "smoe"

    def __init__(self, residency: Residency, precision: Precision, alpha: float | Callable[[], float] = 0.3) -> None:
        """alpha: SMoE's α — the substitution's own where the run substitutes (a callable reading its stage, whose α a
        TPOT budget may tune while running: moetier/plan/pipeline.py), else 0.3, its setting for mid-sized models
        (§V-C)."""
        super().__init__(residency, precision)
        if not callable(alpha) and not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha must be within [0, 1), not {alpha}")
        self._alpha = alpha if callable(alpha) else (lambda: alpha)

    @property
    def alpha(self) -> float:
        return self._alpha()

    def select(self, plan: LayerPlan) -> Iterable[ExpertKey]:
        layer = min(plan.predictions)
        scores = plan.predictions[layer]  # [T, E]
        k = plan.route.topk_ids.shape[1]
        if k >= scores.shape[1]:
            return [ExpertKey(layer, e) for e in range(scores.shape[1])]
        ranked = -np.sort(-scores, axis=1)  # [T, E] descending
        bound = (1 + self.alpha) * ranked[:, k:k + 1]  # [T, 1]: (1+α)·S_{k+1}
        top = (scores >= bound) & (scores >= ranked[:, k - 1:k])  # [T, E]: top-score and among the top-k
        ids = np.flatnonzero(top.any(axis=0))
        ids = ids[np.argsort(-scores[:, ids].sum(axis=0), kind="stable")]
        return [ExpertKey(layer, int(e)) for e in ids]


class ComoePrefetch(PrefetchStage):
    name = "comoe"

    def __init__(self, residency: Residency, precision: Precision, costs: RunningCosts, theta_base: float | None = None,
                 delta: float = 0.5, top_k: int = 1, memory: DeviceMemory | None = None) -> None:
        """The paper gives no values for θ_base or δ. θ_base defaults to half of 1/k, the probability a routed
        expert has on average when the router's k choices share it evenly. `memory`: the device's free share,
        m_avail/m_GPU (moetier/plan/device_memory.py; None: none free, as a machine whose memory the cache fills)."""
        super().__init__(residency, precision)
        self.costs, self.delta = costs, delta
        self.memory = memory or FixedMemory()
        self.theta_base = theta_base if theta_base is not None else 0.5 / top_k
        if not 0.0 < self.theta_base < 1.0 or delta < 0:
            raise ValueError(f"need 0 < theta_base < 1 and delta >= 0 (got {self.theta_base}, {delta})")

    def threshold(self) -> float:
        """θ_pre(t) = θ_base · S_b(t) · (1 + δ · m_avail/m_GPU) (Eq. 19, as printed: more free memory and a
        steadier link raise the bar, although the paper's prose says a steadier link makes it more aggressive);
        m_avail/m_GPU the device's free memory, not the cache's."""
        return self.theta_base * self.costs.bandwidth_stability() * (1 + self.delta * self.memory.free_share())

    def select(self, plan: LayerPlan) -> Iterable[ExpertKey]:
        layer = min(plan.predictions)
        scores = plan.predictions[layer]  # [T, E]
        p = scores / np.maximum(scores.sum(axis=1, keepdims=True), 1e-30)  # a distribution per token, as Eq. 36's
        best = p.max(axis=0)  # [E]
        ids = np.flatnonzero(best > self.threshold())
        return [ExpertKey(layer, int(e)) for e in ids[np.argsort(-best[ids], kind="stable")]]


class Comoe37Prefetch(ComoePrefetch):
    """CoMoE's other printed threshold: θ_pre = γ·M_avail/M (Eq. 37, §III-C's prefetching strategy), γ = θ_base.
    Eq. 19 (§III-A, Algorithm 4's decision function) also weighs the link's stability S_b; Eq. 37 weighs the memory
    alone. The paper's evaluation does not say which ran; `comoe` (Eq. 19) is the default for being the one its
    resource-perception algorithm computes, and the only one that reacts to the link, which is what this engine's
    reads contend for."""

    name = "comoe-37"

    def threshold(self) -> float:
        """θ_pre = γ·M_avail/M_GPU: the device's free memory (a full cache on a machine with room keeps it > 0)."""
        return self.theta_base * self.memory.free_share()


class PreSchedPrefetch(PrefetchStage):
    name = "presched"

    def __init__(self, residency: Residency, precision: Precision, costs: RunningCosts, prior_hit: float = 0.5,
                 smoothing: float = 0.1, cpu_lane: bool = False) -> None:
        """prior_hit: the hit rate assumed for a prefetch rank never tried; each rank's is then smoothed.
        cpu_lane: a placement stage may compute misses on the host, so Eq. 4 decides which predicted experts the GPU
        needs at all; without one every predicted miss would be loaded."""
        super().__init__(residency, precision)
        self.costs, self.prior_hit, self.smoothing, self.cpu_lane = costs, prior_hit, smoothing, cpu_lane
        self.rank_hit: list[float] = []  # per rank among a layer's prefetches: how often such a prefetch was used
        self._rank: dict[ExpertKey, int] = {}

    def slack(self, plan: LayerPlan) -> float:
        """T_gap + t_attn before α: the link time this layer leaves free (Eq. 6's numerator, α added back). T_gap is
        the CPU computation of the experts a placement stage put on the host less this layer's own reads; with none
        (no CPU lane), the compute of the experts this layer does not load stands in for it."""
        c = self.costs
        reads = sum(1 for run in plan.runs if run.source in (LOAD, IN_FLIGHT))  # this layer's, on the link first
        host = [run for run in plan.runs if run.place == HOST]
        counts = plan.counts
        busy = sum(c.host_s(int(counts[run.expert])) for run in host) if host else \
            (len(plan.runs) - reads) * c.expert_s
        return busy - reads * c.read_s + c.dense_s

    def count(self, plan: LayerPlan, window: int = 1) -> int:
        """|f| per Eq. 6–7 for prefetches aimed `window` layers ahead: f = (T_gap + t_attn) / t_io with the gap of
        the `window` layers before the target, each taken to leave the link what this one does (Q4's larger window),
        less α, the link time our earlier prefetches still take; the critical |f|-th kept only when ξ > 0."""
        c = self.costs
        alpha = self.reading() * c.read_s  # PreScope's α
        f = max(0.0, (window * self.slack(plan) - alpha) / c.read_s)  # Eq. 6
        n = round(f)
        if n == 0:
            return 0
        hit = self.rank_hit[n - 1] if n - 1 < len(self.rank_hit) else self.prior_hit
        t_e = c.expert_s
        xi = hit * (f - n + 1) * t_e - (1 - hit) * (n - f) * t_e  # Eq. 7
        return n if xi > 0 else n - 1

    def __call__(self, plan: LayerPlan) -> LayerPlan:
        self._learn(plan)
        return super().__call__(plan)

    def wanted(self, plan: LayerPlan, window: list[int],
               misses: dict[int, list[tuple[int, ExpertKey]]]) -> list[ExpertKey]:
        """GPU_Q ∩ E_target, most tokens first, for the window's last layer E_target: with a CPU lane, Eq. 4 on this
        layer's misses and the window's predicted ones (t_attn once per layer); without, every predicted miss.
        `misses`: each predicted layer's `predicted_misses`, computed once per plan."""
        target = misses[window[-1]]
        if not (self.cpu_lane and self.costs.placement_ready):
            return [key for _, key in target]
        counts = plan.counts
        cur = [(int(counts[run.expert]), plan.layer, run.expert) for run in plan.runs
               if run.source in (LOAD, IN_FLIGHT) or run.place == HOST]
        ahead = [(m, key.layer, key.expert) for layer in window for m, key in misses[layer][::-1]]  # worst first
        queue = gpu_queue(cur + ahead, self.costs, self.reading() * self.costs.read_s,
                          len(window) * self.costs.dense_s)
        return [ExpertKey(layer, e) for _, layer, e in reversed(queue) if layer == window[-1]]

    def select(self, plan: LayerPlan) -> Iterable[ExpertKey]:
        """Alg. 1's PrefetchDecision: |f| of the next layer's experts in the GPU queue; when the GPU queue holds none
        of them (Q4, common at small batches, where the CPU computes every miss), the window grows a layer at a time
        up to the predictor's distance, the target its last layer, under the same trade-off (Eq. 4, 6, 7). Ours:
        the target is the first window whose last layer has queued experts; the gap is the window's."""
        if not self.costs.ready:
            return []  # nothing measured yet: no budget to schedule against
        layers = sorted(plan.predictions)
        k = plan.route.topk_ids.shape[1]
        masked = [key for key in (ExpertKey(layers[0], e) for e in predicted_ids(plan.predictions[layers[0]], k))
                  if key in self.residency.entries]  # the next layer's resident predicted experts: pinned, not read
        misses = {layer: predicted_misses(plan, self.residency, layer) for layer in layers}
        for d in range(1, len(layers) + 1):
            chosen = self.wanted(plan, layers[:d], misses)
            if chosen:
                chosen = chosen[:self.count(plan, d)]
                self._rank.update((key, i) for i, key in enumerate(chosen))
                return masked + chosen
        return masked

    def _learn(self, plan: LayerPlan) -> None:
        """Before settling: each prefetch aimed at this layer teaches its rank's hit rate."""
        used = {run.expert for run in plan.runs}
        for key in [key for key in self._rank if key.layer == plan.layer]:
            rank = self._rank.pop(key)
            while len(self.rank_hit) <= rank:
                self.rank_hit.append(self.prior_hit)
            self.rank_hit[rank] += self.smoothing * (float(key.expert in used) - self.rank_hit[rank])

Factory = Callable[..., PrefetchStage]
PREFETCHERS: dict[str, Factory] = {
    "hobbit": HobbitPrefetch,
    "ahead": AheadPrefetch,
    "smoe": SmoePrefetch,
    "comoe": ComoePrefetch,
    "comoe-37": Comoe37Prefetch,
    "presched": PreSchedPrefetch,
}
NEEDS_COSTS = ("comoe", "comoe-37", "presched")


def layer_stages(residency: Residency, precision: Precision, prefetch: str, predictor, costs: RunningCosts,
                 top_k: int, params: dict | None = None) -> list:
    """The planner's stages for exact mode with `prefetch` (or "none"): on-demand, then the prefetch stage, which
    needs a predictor. What both executors build."""
    stages = [OnDemandStage(residency)]
    if prefetch != "none":
        if predictor is None:
            raise MoetierError(f"prefetch {prefetch!r} needs a predictor", hint="give a predictor (--predictor NAME)")
        stages.append(make_prefetcher(prefetch, residency, precision, costs, top_k, **(params or {})))
    return stages


def make_prefetcher(name: str, residency: Residency, precision: Precision, costs: RunningCosts,
                    top_k: int, **params) -> PrefetchStage:
    """The stage `name`, or a clear error."""
    if name not in PREFETCHERS:
        raise MoetierError(f"unknown prefetcher {name!r}", hint=f"one of none, {', '.join(PREFETCHERS)}")
    memory = params.pop("memory", None)  # the device's free memory: CoMoE's thresholds read it
    if name in ("comoe", "comoe-37"):
        params.setdefault("top_k", top_k)
        params["memory"] = memory
    if name in NEEDS_COSTS:
        params["costs"] = costs
    return PREFETCHERS[name](residency, precision, **params)
