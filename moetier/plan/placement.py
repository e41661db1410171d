"""Placement: for each expert a layer needs and the fast tier does not hold, load it (FAST) or compute it where its
weights live (HOST: the CPU beside a GPU, from host memory). A stage after the precision stage and before the
on-demand one; it only sets `plan.place`, and the on-demand stage gives a HOST expert a run with no slot and no
read. Each decides from the running costs both executors report (moetier/plan/costs.py): t_io one read, t_g one
expert on the compute device, t_attn a layer's dense part, t_c(m) = β·m + C one expert of m tokens on the host.

- `smoe-two-pointer`  SMoE Alg. 2 (§V-A): misses by score, descending; a left pointer loads (from the top), a right
                      one computes on the CPU (from the bottom), each step advancing the side with less time so far:
                      min max(n_load·C_load, n_cpu·C_cpu), high-score experts loaded (they are reused more, Fig. 6).
- `prescope`          PreScope's PreSched (§4.3, Alg. 1, Eq. 3–5): the current layer's misses and the next layer's
                      predicted ones, in ascending order of tokens, in one queue; an expert goes to the GPU queue
                      when loading the rest from it beats the CPU for everything up to it (Eq. 4); the current
                      layer loads its suffix from the smallest index i' where loading beats the CPU (Eq. 5) and
                      computes the rest on the CPU. Its prefetch (`--prefetch presched`) then fills the gap the CPU
                      leaves the link (Eq. 6–7).
- `greedy`            the layer-by-layer baseline PreScope compares with: Eq. 5 on the current layer alone.
- `hobbit-coop`       HOBBIT's CPU-GPU cooperative mode (§4): in decoding a missing expert is computed by the CPU
                      (its input sent there, its output back); the prompt runs on the GPU alone (§5.4).
- `cpu-offload`       the baseline of SMoE's ablation (§VI, Fig. 14), llama.cpp's expert offloading: every expert
                      the fast tier does not hold is computed by the CPU from host memory, prompt and decode alike;
                      nothing is ever loaded, so the cache keeps what it started with (with `--preload`, a fixed
                      set of experts, layer by layer, as llama.cpp keeps some on the GPU)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.cache.residency import Residency
from moetier.errors import MoetierError
from moetier.plan.costs import RunningCosts
from moetier.plan.layer_plan import HOST, LayerPlan
from moetier.plan.prefetch import predicted_ids
from moetier.plan.route import DECODE


class PlacementStage:
    name = "placement"

    def __init__(self, residency: Residency, costs: RunningCosts) -> None:
        self.residency, self.costs = residency, costs

    def misses(self, plan: LayerPlan) -> list[int]:
        """Needed experts with no cache entry and no run yet (a low tier's), ascending."""
        planned = {run.expert for run in plan.runs}
        return [e for e in plan.experts
                if e not in planned and ExpertKey(plan.layer, e) not in self.residency.entries]

    def __call__(self, plan: LayerPlan) -> LayerPlan:
        misses = self.misses(plan)
        if misses and self.costs.placement_ready:
            for e in self.on_host(plan, misses):
                plan.place[e] = HOST
        return plan

    def on_host(self, plan: LayerPlan, misses: list[int]) -> list[int]:
        raise NotImplementedError


def importance(plan: LayerPlan) -> np.ndarray:
    """[E] the summed gate weight each expert gets from the step's tokens (its score, for a batch)."""
    ids, w = plan.assign_ids, plan.assign_weights
    out = np.zeros(plan.route.scores.shape[1])
    np.add.at(out, ids[ids >= 0], w[ids >= 0])
    return out


class SMoETwoPointer(PlacementStage):
    name = "smoe-two-pointer"

    def on_host(self, plan: LayerPlan, misses: list[int]) -> list[int]:
        score, counts, c = importance(plan), plan.counts, self.costs
        ranked = sorted(misses, key=lambda e: -score[e])  # S: descending score
        t_load = t_cpu = 0.0
        left, right = 0, len(ranked) - 1
        while left <= right:
            if t_load <= t_cpu:
                t_load += c.read_s  # C_load
                left += 1
            else:
                t_cpu += c.host_s(int(counts[ranked[right]]))  # C_cpu (ours: at the expert's own token count)
                right -= 1
        return ranked[left:]


def layer_split(misses: list[int], counts: np.ndarray, costs: RunningCosts, alpha_s: float, start: int = 0,
                default: int | None = None) -> int:
    """Eq. 5 on misses in ascending order of tokens: the smallest i' >= `start` whose suffix loads faster than the
    CPU computes the prefix, T_G = α + (n − i' + 1)·t_io + t_g < T_C = t_c(E[0 … i' − 1]); `default` if none
    (None: len(misses), all on the CPU)."""
    n = len(misses)
    prefix = np.concatenate([[0.0], np.cumsum([costs.host_s(int(counts[e])) for e in misses])])  # t_c(E[0 … i−1])
    for i in range(start, n):
        if alpha_s + (n - i) * costs.read_s + costs.expert_s < prefix[i]:
            return i
    return n if default is None else default


class GreedyPlacement(PlacementStage):
    """Layer by layer: Eq. 5 on the current layer's misses alone (no look at the next layer, no prefetch)."""

    name = "greedy"

    def __init__(self, residency: Residency, costs: RunningCosts, reading: Callable[[], int] = lambda: 0) -> None:
        super().__init__(residency, costs)
        self.reading = reading  # prefetch reads still holding the link (PreScope's α)

    def on_host(self, plan: LayerPlan, misses: list[int]) -> list[int]:
        counts = plan.counts
        ordered = sorted(misses, key=lambda e: (counts[e], e))  # ascending tokens
        return ordered[:layer_split(ordered, counts, self.costs, self.reading() * self.costs.read_s)]


def gpu_queue(entries: list[tuple[int, int, int]], costs: RunningCosts, alpha_s: float,
              dense_s: float) -> list[tuple[int, int, int]]:
    """PreScope's Eq. 4 on E_all, the (tokens, layer, expert) of the current layer's misses and the predicted ones of
    the layers after it: in ascending order of tokens, the GPU queue is E_all[k …] from the first k where loading it,
    T_G = α + (N − k)·t_io + t_g, beats the CPU for everything up to it, T_C = t_c(E_all[0 … k]) + t_attn (`dense_s`:
    the window's dense parts). Ties in tokens put the nearer layer first (the farther one is queued first), then
    keep the order given: give each layer's experts worst first."""
    merged = sorted(entries, key=lambda x: x[:2])  # stable
    total = len(merged)
    t_c = np.cumsum([costs.host_s(m) for m, _, _ in merged])  # t_c(E_all[0 … k])
    first = next((k for k in range(total) if alpha_s + (total - k) * costs.read_s + costs.expert_s < t_c[k] + dense_s),
                 total)
    return merged[first:]


def predicted_misses(plan: LayerPlan, residency: Residency, layer: int) -> list[tuple[int, ExpertKey]]:
    """`layer`'s predicted experts (a token's predicted top-k) not in the cache, best first, with how many tokens are
    predicted to use each."""
    scores = plan.predictions[layer]  # [T, E]
    k = plan.route.topk_ids.shape[1]
    top = np.argpartition(-scores, min(k, scores.shape[1]) - 1, axis=1)[:, :k]  # [T, k]
    tokens = np.bincount(top.ravel(), minlength=scores.shape[1])
    return [(int(tokens[e]), ExpertKey(layer, e)) for e in predicted_ids(scores, k)
            if ExpertKey(layer, e) not in residency.entries]


class PreSchedPlacement(GreedyPlacement):
    """PreScope's cross-layer placement (Eq. 4, then Eq. 5 on the current layer's part of the GPU queue)."""

    name = "prescope"

    def on_host(self, plan: LayerPlan, misses: list[int]) -> list[int]:
        c, counts = self.costs, plan.counts
        alpha_s = self.reading() * c.read_s
        cur = sorted(misses, key=lambda e: (counts[e], e))  # E_cur, ascending tokens
        nxt = predicted_misses(plan, self.residency, min(plan.predictions)) if plan.predictions else []  # E_next
        entries = [(int(counts[e]), plan.layer, e) for e in cur] + [(m, key.layer, key.expert) for m, key in nxt[::-1]]
        queued_cur = [e for _, layer, e in gpu_queue(entries, c, alpha_s, c.dense_s) if layer == plan.layer]
        if not queued_cur:
            return cur  # Eq. 4 sends none of this layer's experts to the GPU (Alg. 1's i = n would load E_cur[n])
        # Alg. 1's OndemandLoop: the first of them, from the smallest, where Eq. 5 holds; if none, i = n: the
        # largest loads
        i = layer_split(cur, counts, c, alpha_s, start=cur.index(queued_cur[0]), default=len(cur) - 1)
        return cur[:i]


class HobbitCoop(PlacementStage):
    name = "hobbit-coop"

    def __call__(self, plan: LayerPlan) -> LayerPlan:
        if plan.route.phase == DECODE:  # the prompt runs on the GPU alone (§5.4); no costs weighed
            for e in self.misses(plan):
                plan.place[e] = HOST
        return plan


class CpuOffload(PlacementStage):
    name = "cpu-offload"

    def __call__(self, plan: LayerPlan) -> LayerPlan:
        for e in self.misses(plan):  # no costs weighed: the baseline never reads an expert
            plan.place[e] = HOST
        return plan


PLACEMENTS = {"smoe-two-pointer": SMoETwoPointer, "prescope": PreSchedPlacement, "greedy": GreedyPlacement,
              "hobbit-coop": HobbitCoop, "cpu-offload": CpuOffload}


def make_placement(name: str, residency: Residency, costs: RunningCosts,
                   reading: Callable[[], int] = lambda: 0) -> PlacementStage:
    if name not in PLACEMENTS:
        raise MoetierError(f"unknown placement {name!r}", hint=f"one of none, {', '.join(PLACEMENTS)}")
    cls = PLACEMENTS[name]
    return cls(residency, costs, reading) if issubclass(cls, GreedyPlacement) else cls(residency, costs)
