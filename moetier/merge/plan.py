"""Which experts of a layer CoMoE keeps and which it folds into them (§III-B, Eq. 28–33): pure arithmetic on a
layer's activation counts and expert similarities, no tensors of weights, no files.

Step 1 (Eq. 28): an expert's activation frequency is its share of the layer's activations on calibration text.
Principal experts: those above θ_act, or — where a ratio fixes how many are kept — the E' most frequent (ties to
the lower id). Step 2 (Eq. 29): every other expert joins the principal it is most similar to (S of Eq. 27; ties to
the lower id). Step 3 (Eq. 30, moetier/merge/merge.py): each group becomes one expert, its members averaged with
their frequencies as weights.

How many are kept: a fixed ratio, E' = ⌊r·E⌋ (the paper's light/medium/heavy r = 0.75/0.5/0.25), or adaptive from
the layer's normalised routing entropy (Eq. 31–33): E'_l = max(E_min, ⌊E·(r_base + Δr·H̄_l)⌋) — a layer whose
routing is spread over many experts keeps more of them. Either way never fewer than the router's top-k (a token
needs k distinct experts) nor more than E."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moetier.errors import MoetierError

# The paper's presets (§III-B 4): fixed ratios and adaptive (r_base, Δr).
FIXED = {"light": 0.75, "medium": 0.5, "heavy": 0.25}
ADAPTIVE = {"light": (0.6, 0.3), "medium": (0.4, 0.2), "heavy": (0.2, 0.1)}


@dataclass(frozen=True)
class FixedRatio:
    """E' = ⌊r·E⌋ experts kept in every layer."""

    ratio: float

    def __post_init__(self) -> None:
        if not 0 < self.ratio <= 1:
            raise MoetierError(f"a merge ratio must be in (0, 1], got {self.ratio}",
                               hint="--ratio 0.5 keeps half the experts of each layer")

    def kept(self, frequency: np.ndarray) -> int:
        return math.floor(self.ratio * len(frequency))

    @property
    def name(self) -> str:
        return f"ratio-{self.ratio:g}"


@dataclass(frozen=True)
class AdaptiveRatio:
    """E'_l = max(E_min, ⌊E·(r_base + Δr·H̄_l)⌋), H̄_l the layer's routing entropy over log E (Eq. 31–33)."""

    r_base: float
    delta_r: float
    min_experts: int = 1
    label: str = ""

    def __post_init__(self) -> None:
        if not (0 < self.r_base <= 1 and 0 <= self.delta_r <= 1 and self.min_experts >= 1):
            raise MoetierError(f"adaptive merging needs 0 < r_base <= 1, 0 <= Δr <= 1 and E_min >= 1, got "
                               f"{self.r_base}, {self.delta_r}, {self.min_experts}")

    def kept(self, frequency: np.ndarray) -> int:
        num = len(frequency)
        return max(self.min_experts, math.floor(num * (self.r_base + self.delta_r * normalised_entropy(frequency))))

    @property
    def name(self) -> str:
        return f"adaptive-{self.label}" if self.label else f"adaptive-{self.r_base:g}-{self.delta_r:g}"


@dataclass(frozen=True)
class ActivationThreshold:
    """θ_act (§III-B): keep the experts whose share of a layer's activations is above θ (at least the most used)."""

    theta: float

    def __post_init__(self) -> None:
        if not 0 <= self.theta < 1:
            raise MoetierError(f"--threshold is a share of a layer's activations in [0, 1), got {self.theta}",
                               hint="--threshold 0.05 keeps the experts taking more than 5% of a layer's tokens")

    def kept(self, frequency: np.ndarray) -> int:
        return len(choose_principals(frequency, threshold=self.theta))

    @property
    def name(self) -> str:
        return f"threshold-{self.theta:g}"


Retention = FixedRatio | AdaptiveRatio | ActivationThreshold


def activation_frequency(counts: np.ndarray) -> np.ndarray:
    """Eq. 28: counts [E] of a layer's activations on calibration text -> shares [E] summing to 1."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 1 or (counts < 0).any() or counts.sum() <= 0:
        raise MoetierError("activation counts must be non-negative, one per expert, and not all zero",
                           hint="the calibration text routed no token through this layer: give a longer one")
    return counts / counts.sum()


def normalised_entropy(frequency: np.ndarray) -> float:
    """Eq. 31–32: -Σ f log f over log E (0 where one expert takes everything, 1 where all are used alike)."""
    f = np.asarray(frequency, dtype=np.float64)
    nz = f[f > 0]
    return float(-(nz * np.log(nz)).sum() / math.log(len(f))) if len(f) > 1 else 0.0


def combined_similarity(param: np.ndarray, func: np.ndarray, alpha: float) -> np.ndarray:
    """Eq. 27: α·S_param + (1 − α)·S_func, each [E, E]."""
    if not 0 <= alpha <= 1:
        raise MoetierError(f"alpha must be in [0, 1], got {alpha}", hint="--alpha 0.5 weighs both alike")
    return alpha * np.asarray(param, dtype=np.float64) + (1 - alpha) * np.asarray(func, dtype=np.float64)


@dataclass(frozen=True)
class LayerMerge:
    """One layer's outcome: `principals` (ascending ids, the experts kept), `group_of` [E] (each expert's principal,
    a principal its own) and `frequency` [E] (Eq. 28, the averaging weights of Eq. 30)."""

    principals: tuple[int, ...]
    group_of: tuple[int, ...]
    frequency: tuple[float, ...]

    def __post_init__(self) -> None:
        kept = set(self.principals)
        if list(self.principals) != sorted(kept) or not kept:
            raise ValueError("principals must be distinct ascending ids, at least one")
        if len(self.group_of) != len(self.frequency) or any(self.group_of[p] != p for p in self.principals) \
                or any(g not in kept for g in self.group_of):
            raise ValueError("every expert must map to a principal, and each principal to itself")

    def members(self, principal: int) -> list[int]:
        return [e for e, g in enumerate(self.group_of) if g == principal]


def choose_principals(frequency: np.ndarray, kept: int | None = None, threshold: float | None = None) -> list[int]:
    """Step 1: the `kept` most frequent experts (ties to the lower id), or every one above `threshold` (θ_act)."""
    f = np.asarray(frequency, dtype=np.float64)
    if (kept is None) == (threshold is None):
        raise ValueError("give either the number to keep or the threshold")
    if threshold is not None:
        chosen = [int(e) for e in np.flatnonzero(f > threshold)]
        return chosen or [int(np.argmax(f))]  # (a threshold above every frequency keeps the most used one)
    order = sorted(range(len(f)), key=lambda e: (-f[e], e))
    return sorted(order[:kept])


def group(similarity: np.ndarray, principals: list[int]) -> list[int]:
    """Step 2 (Eq. 29): each expert's most similar principal (ties to the lower id); a principal is its own."""
    s = np.asarray(similarity, dtype=np.float64)
    out = []
    for e in range(s.shape[0]):
        if e in principals:
            out.append(e)
        else:
            out.append(max(principals, key=lambda p: (s[e, p], -p)))
    return out


def plan_layer(counts: np.ndarray, similarity: np.ndarray, retention: Retention, top_k: int) -> LayerMerge:
    """A layer's merge: as many principals as `retention` keeps (at least top_k, at most E) — a ratio's count, or
    those above θ_act, which are the most frequent too —, each other expert grouped to its most similar
    principal."""
    frequency = activation_frequency(counts)
    principals = choose_principals(frequency, kept=min(len(frequency), max(top_k, retention.kept(frequency))))
    return LayerMerge(tuple(principals), tuple(group(similarity, principals)), tuple(float(x) for x in frequency))
