"""Which precision each needed expert is computed at: HOBBIT's token-level dynamic expert loading (§3.2), and the
`low-tier` mode built on it.

`MixedPrecision` configures a run:
- `native` (exact mode), or `int8`/`int4`/`int2` or a GGML block format (`q8_0`/`q6_k`/`q5_k`/`q4_k`): every
  expert at that one precision (the store's copies);
- `hobbit`: each needed expert's precision from its gate, cached or not (§3.2): high if it matters for its token
  (the token's first expert always), low if it matters less, or skipped. A cached high copy serves a low need; a
  cached low copy serves only a low need — for an important expert it is a miss at high precision (the low entry
  leaves, the high copy is read), unless its read is still in flight. The cache is split into a high- and a
  low-precision sub-cache (§3.4) by `high_share` of the bytes. `cached="as-held"` (ours, moetier before
  2026-11-27) runs any cached copy at the precision it is held at: fewer reads, important experts at low precision
  (25–43% of top-1 experts on Mixtral's routing, against the paper's 0);
- `low-tier` (ours): every expert resident at the low precision (read once at start-up, out of the budget); the
  rest of the budget a high-precision cache. An expert the stage calls important is computed at high precision
  (from the cache, or read from disk into it); the others from their resident low copy; nothing waits for the
  disk unless it matters.

The importance (Eq. 2): the token's selected experts in descending order of their normalised gate value, s_i the
sum of the gates before expert i; s_i <= T1 high, T1 < s_i <= T2 low, s_i > T2 skip; the first expert always high.
An expert several tokens of a step select takes the most important of its uses (a prompt's tokens share one
plan): it is skipped only where every token would skip it, and then for all of them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.base import EvictionPolicy
from moetier.cache.residency import Residency
from moetier.config import format_bytes
from moetier.errors import BudgetError, MoetierError
from moetier.plan.layer_plan import RESIDENT, SKIP, LayerPlan, Run
from moetier.quant.precisions import QUANTIZED

MODES = ("native", *QUANTIZED, "hobbit", "low-tier")
PAPER_T1, PAPER_T2 = 0.6, 0.9  # HOBBIT §3.2
# What the paper's thresholds do on Mixtral-8x7B's real routing (data/traces/mixtral-8x7b, 577 tokens x 32
# layers, top-2): the shares of selected experts loaded high, low and skipped. Per-model defaults keep these shares.
HOBBIT_SHARES = (0.636, 0.318, 0.046)
UNIFORM = QUANTIZED  # every expert at one quantized copy (most precise first: low-tier takes the first that fits)
HIGH, LOW, SKIPPED = 0, 1, 2  # an assignment's level
CACHED = ("by-gate", "as-held")  # hobbit: what a cached copy of the other precision does (PrecisionStage's classes)


@dataclass(frozen=True)
class MixedPrecision:
    mode: str = "native"
    high: Precision = ""  # "": the model's own precision
    low: Precision = ""  # "": int4 for hobbit; for low-tier the most precise copy that fits (see engine)
    t1: float | None = None  # None: the model's fitted default (thresholds.json beside it), else HOBBIT's 0.6
    t2: float | None = None  # None: likewise, else 0.9; for low-tier 1.0 (its low copy is resident: skipping saves
    # no read)
    high_share: float = 0.75  # hobbit: the high-precision sub-cache's share of the bytes
    cached: str = "by-gate"  # hobbit: a cached low copy of an important expert is a miss (the paper), or "as-held"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise MoetierError(f"unknown precision mode {self.mode!r}", hint=f"one of {', '.join(MODES)}")
        if self.cached not in CACHED:
            raise MoetierError(f"unknown cached-copy rule {self.cached!r}", hint=f"one of {', '.join(CACHED)}")
        if self.t2 is None and self.mode == "low-tier":
            object.__setattr__(self, "t2", 1.0)
        if (self.t1 is not None and self.t1 < 0) or (None not in (self.t1, self.t2) and self.t1 > self.t2):
            raise MoetierError(f"thresholds need 0 <= T1 <= T2, got T1={self.t1}, T2={self.t2}")
        if not 0 < self.high_share <= 1:
            raise MoetierError(f"high_share must be in (0, 1], got {self.high_share}")
        if self.low and self.low == self.high:
            raise MoetierError(f"high and low precision are both {self.low}", hint="give two different copies")
        if self.low and self.low not in UNIFORM:
            raise MoetierError(f"unknown low precision {self.low!r}", hint=f"one of {', '.join(UNIFORM)}")

    def with_thresholds(self, fitted: tuple[float, float] | None = None) -> MixedPrecision:
        """Thresholds not given filled in: from `fitted` (a model's defaults), else the paper's."""
        t1, t2 = fitted or (PAPER_T1, PAPER_T2)
        return dataclasses.replace(self, t1=t1 if self.t1 is None else self.t1, t2=t2 if self.t2 is None else self.t2)

    @property
    def mixed(self) -> bool:
        return self.mode in ("hobbit", "low-tier")

    def pair(self, native: Precision, default_low: Precision = "int4") -> tuple[Precision, Precision]:
        """(high, low) for a model whose own precision is `native`."""
        return self.high or native, self.low or default_low

    def host_precisions(self, native: Precision, default_low: Precision = "int4") -> tuple[Precision, ...]:
        """The precisions placement keeps every expert at in host memory: the one the cache reads, and HOBBIT's low
        one too (§4, Fig. 13: all experts in CPU memory in each precision; a missing expert its loader wants low is
        computed by the CPU from the low copy). Low-tier's low copies are resident already."""
        if self.mode in UNIFORM:
            return (self.mode,)
        high, low = self.pair(native, default_low)
        return (high, low) if self.mode == "hobbit" else (high,)

    def precisions(self, native: Precision, default_low: Precision = "int4") -> tuple[Precision, ...]:
        """The precisions the store must hold for this mode."""
        if self.mode == "native":
            return (native,)
        if self.mode in UNIFORM:
            return (self.mode,)
        return self.pair(native, default_low)


def fit_thresholds(topk_weights: np.ndarray, shares: tuple[float, float, float] = HOBBIT_SHARES) -> tuple[float, float]:
    """T1, T2 for a model: the thresholds under which its selected experts (routing weights [N, k]) are loaded high,
    low and skipped in `shares` — by default what HOBBIT's own thresholds give on Mixtral, whose top-2 they were set
    for. (A top-8 model's later experts have small s: under 0.6 / 0.9 it would skip a third of them.)"""
    w = np.abs(topk_weights.astype(np.float64))
    w = w / np.maximum(w.sum(axis=1, keepdims=True), 1e-30)
    ranked = -np.sort(-w, axis=1)
    s = (np.cumsum(ranked, axis=1) - ranked)[:, 1:].ravel()  # the first expert is high whatever its s
    k = w.shape[1]
    if k == 1 or s.size == 0:
        return PAPER_T1, PAPER_T2
    first = 1 / k  # of all selected experts, the share that are first
    q_high = float(np.clip((shares[0] - first) / (1 - first), 0, 1))
    q_kept = float(np.clip((1 - shares[2] - first) / (1 - first), 0, 1))
    t1, t2 = (float(np.quantile(s, q)) for q in (q_high, q_kept))
    return round(t1, 4), round(max(t1, t2), 4)


def levels(topk_weights: np.ndarray, t1: float, t2: float) -> np.ndarray:
    """[T, k] router weights -> [T, k] HIGH / LOW / SKIPPED per Eq. 2 (on the weights normalised per token)."""
    w = np.abs(topk_weights.astype(np.float64))
    w = w / np.maximum(w.sum(axis=1, keepdims=True), 1e-30)
    order = np.argsort(-w, axis=1, kind="stable")  # descending gate
    ranked = np.take_along_axis(w, order, axis=1)
    s = np.cumsum(ranked, axis=1) - ranked  # sum of the gates before each: s_0 = 0
    ranked_level = np.where(s <= t1, HIGH, np.where(s <= t2, LOW, SKIPPED))
    ranked_level[:, 0] = HIGH  # the first expert is always important
    out = np.empty_like(ranked_level)
    np.put_along_axis(out, order, ranked_level, axis=1)
    return out


def row_levels(topk_weights: np.ndarray, t1: float, t2: float) -> list[int]:
    """`levels` of a [1, k] row, as a list: the weights normalised in numpy as `levels` normalises each row (the
    same pairwise sum, so the same floats), the rest — a stable descending order, the running sums, the thresholds — in Python, whose float additions are
    numpy's cumsum's one by one (a decode step at batch 1: ten numpy calls on eight numbers cost more than this)."""
    w = np.abs(topk_weights[0].astype(np.float64))  # [k]
    w = (w / max(float(w.sum()), 1e-30)).tolist()  # (the row's pairwise sum as `levels`' per row: the same floats)
    order = sorted(range(len(w)), key=lambda i: -w[i])  # (sorted is stable: ties in index order, as argsort's)
    out, total = [0] * len(w), 0.0
    for rank, i in enumerate(order):
        total = w[i] if rank == 0 else total + w[i]  # cumsum's: the first as it is, then each added
        s = total - w[i]  # the sum of the gates before this one (cumsum - ranked: the same subtraction)
        out[i] = HIGH if rank == 0 or s <= t1 else LOW if s <= t2 else SKIPPED
    return out


class PrecisionStage:
    """HOBBIT's dynamic loader (§3.2), before the on-demand stage: each needed expert's precision from its gate
    (Eq. 2), cached or not. A missing expert gets the precision its importance asks for, or its assignments are
    skipped; an important expert whose low copy is cached is a miss at high precision — the low entry is dropped
    (unless its read is in flight: then it runs low) and the on-demand stage reads the high copy. Every other cached
    expert runs at the precision it is held at (a high copy serves a low need)."""

    name = "precision"

    def __init__(self, residency: Residency, high: Precision, low: Precision, t1: float, t2: float) -> None:
        self.residency, self.high, self.low, self.t1, self.t2 = residency, high, low, t1, t2

    def best_levels(self, ids: np.ndarray, weights: np.ndarray) -> dict[int, int]:
        """[T, k] ids (SKIP for none) and their router weights -> each named expert's most important level over its
        uses (Eq. 2)."""
        if ids.shape[0] == 1:  # (decode at batch 1: one row's k values in Python, not three numpy calls an expert)
            best: dict[int, int] = {}
            for e, lvl in zip(ids[0].tolist(), row_levels(weights, self.t1, self.t2)):
                if e != SKIP and lvl < best.get(e, SKIPPED + 1):
                    best[e] = lvl
            return dict(sorted(best.items()))
        level = levels(weights, self.t1, self.t2)  # [T, k]
        level[ids == SKIP] = SKIPPED
        return {int(e): int(level[ids == e].min()) for e in np.unique(ids[ids != SKIP])}

    def predicted(self, scores: np.ndarray, top_k: int) -> dict[int, Precision | None]:
        """[T, E] a predictor's scores for a coming layer -> the precision this loader would read each predicted
        expert at (each token's predicted top-k, weighed by the predicted scores), None where it would skip it:
        HOBBIT §3.3 prefetches "versions of the experts with different precision levels" (Fig. 9d–e)."""
        k = min(top_k, scores.shape[1])
        ids = np.argpartition(-scores, k - 1, axis=1)[:, :k]  # [T, k]
        best = self.best_levels(ids, np.take_along_axis(scores, ids, axis=1))
        return {e: None if lvl == SKIPPED else self.high if lvl == HIGH else self.low for e, lvl in best.items()}

    def __call__(self, plan: LayerPlan) -> LayerPlan:
        missing, low = self.scan(plan)
        if not missing and not low:  # (most layers once the cache is warm: Eq. 2's levels cost ~0.1 ms a layer)
            return plan
        ids = plan.assign_ids  # [T, k]
        best = self.best_levels(ids, plan.assign_weights)
        for e in low:
            if best[e] == HIGH:  # a miss at high precision (§3.2): its low copy leaves the low sub-cache
                self.residency.drop(ExpertKey(plan.layer, e))
                missing.append(e)
        skipped = []
        for e in missing:
            if best[e] == SKIPPED:
                skipped.append(e)
            else:
                plan.precision[e] = self.high if best[e] == HIGH else self.low
        if skipped:  # (the arrays rebuilt only then: most layers skip nothing)
            skip = np.isin(ids, skipped)  # [T, k]
            plan.reassign(np.where(skip, SKIP, ids), np.where(skip, 0.0, plan.assign_weights).astype(np.float32),
                          self.high)
        return plan

    def scan(self, plan: LayerPlan) -> tuple[list[int], list[int]]:
        """The needed experts not in the cache, and those whose cached copy is the low one, its read landed (one
        still reading runs low): one look each."""
        entries, layer, low_precision = self.residency.entries, plan.layer, self.low
        missing, low = [], []
        for e in plan.experts:
            entry = entries.get(ExpertKey(layer, e))
            if entry is None:
                missing.append(e)
            elif entry.precision == low_precision and not entry.loading:
                low.append(e)
        return missing, low


class AsHeldPrecisionStage(PrecisionStage):
    """`cached="as-held"` (ours): only missing experts get a precision from their gate; a cached copy of either
    precision runs as it is held — an important expert's low copy included."""

    def scan(self, plan: LayerPlan) -> tuple[list[int], list[int]]:
        return super().scan(plan)[0], []


class LowTierStage:
    """After the precision stage, before the on-demand one: an expert wanted at the low precision and not in the
    cache runs from the resident low tier (the slot of the tier's pool at the expert's place among `keys`, the
    model's (layer, expert) in order)."""

    name = "low-tier"

    def __init__(self, residency: Residency, low: Precision, keys: list[tuple[int, int]]) -> None:
        self.residency, self.low = residency, low
        self.index = {key: i for i, key in enumerate(keys)}

    def slot(self, layer: int, expert: int) -> int:
        return self.index[(layer, expert)]

    def __call__(self, plan: LayerPlan) -> LayerPlan:
        for e, precision in plan.precision.items():
            if precision == self.low and ExpertKey(plan.layer, e) not in self.residency.entries:
                plan.runs.append(Run(e, self.low, self.slot(plan.layer, e), RESIDENT, plan.place[e]))
        return plan


@dataclass
class PrecisionSetup:
    """The cache and the stages a precision mode runs with, as both executors build them: a residency of the
    precisions the cache holds (split into sub-caches for hobbit), the stages before the on-demand one, and the
    low tier's stage and bytes (low-tier only; the executor fills the tier)."""

    high: Precision
    low: Precision
    residency: Residency
    stages: list
    tier: LowTierStage | None = None
    tier_bytes: int = 0


def setup(mixed: MixedPrecision, native: Precision, entry_bytes: dict[Precision, int], capacity_bytes: int,
          policy: EvictionPolicy, moe_layers: tuple[int, ...], num_experts: int, top_k: int,
          per_layer: bool = False, keys: list[tuple[int, int]] | None = None) -> PrecisionSetup:
    """`entry_bytes`: one expert's bytes at each precision the store holds; `capacity_bytes`: the expert budget;
    `keys`: the (layer, expert) the model holds (default: every expert of every MoE layer; a merged model's fewer)."""
    keys = keys if keys is not None else [(layer, e) for layer in moe_layers for e in range(num_experts)]
    mixed = mixed.with_thresholds()  # any still unset: the paper's
    high, low = mixed.pair(native)
    if mixed.mode in UNIFORM:
        high = mixed.mode
    tier_bytes = 0
    if mixed.mode == "low-tier":
        tier_bytes = entry_bytes[low] * len(keys)
        if tier_bytes + top_k * entry_bytes[high] > capacity_bytes:
            raise BudgetError(f"low-tier keeps every expert at {low} ({format_bytes(tier_bytes)}) and needs room "
                              f"for one layer's top-{top_k} at {high} beside them: more than the expert budget "
                              f"({format_bytes(capacity_bytes)})",
                              hint="give more --expert-memory, or a lower --low-precision")
    shares = {high: mixed.high_share, low: 1 - mixed.high_share} if mixed.mode == "hobbit" else None
    cached = {p: entry_bytes[p] for p in (shares or (high,))}
    residency = Residency(capacity_bytes - tier_bytes, cached, policy, moe_layers if per_layer else None, shares)
    loader = AsHeldPrecisionStage if mixed.cached == "as-held" else PrecisionStage
    stages = [loader(residency, high, low, mixed.t1, mixed.t2)] if mixed.mixed else []
    tier = LowTierStage(residency, low, keys) if tier_bytes else None
    if tier is not None:
        stages.append(tier)
    return PrecisionSetup(high, low, residency, stages, tier, tier_bytes)
