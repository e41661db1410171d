"""Resource perception and the decisions drawn from it (CoMoE §III-A): pure arithmetic on measurements handed in —
no file, no clock, no thread — so a hand-made series tests it and the engine and the simulator can drive it alike.

An indicator r(t) (the memory the expert cache could have, the read bandwidth, a layer's compute time) is smoothed
by an exponentially weighted moving average (Eq. 10, r̂(t) = α·r(t) + (1 − α)·r̂(t − 1)), and its stability is
S_r(t) = 1 − σ_r(t)/r̂(t) (Eq. 11) with σ_r the deviation of the last w samples from r̂ (Eq. 12) — clamped to
[0, 1] here (the paper leaves it unbounded below; as a multiplier a negative stability means nothing).

From them:
- how many experts the model should have after aggregation (Eq. 17): E'(t) = min(max(1, ⌊A_m·m_avail(t) /
  (S_e·(1 + β(1 − S_m(t))))⌋), E), S_e one expert's bytes, A_m the share of the memory given to experts, β the
  aversion to risk: an unsteady memory (low S_m) keeps more in reserve. The engine's variant hook picks the variant
  by it (engine/adapt_variant.py); `--adapt`'s cache sizing uses the same formula for a slot count (ours, named in
  engine/adapt_cache.py), its floor one layer's top-k (a layer needs its k experts at once) where the paper's is 1;
- an expert's offload priority (Eq. 18): P = γ·f_act + (1 − γ)·s/L_comm — how much keeping it saves (often used,
  slow to bring back);
- which library variant to run (Eq. 34–35): the best quality that fits the memory now, switched to only when the
  gain outweighs the cost of switching and the new state has held for T_threshold.

The paper gives no values for α, w, A_m, β, γ, λ or T_threshold; the defaults here are named with their reason."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


class Indicator:
    """One resource indicator: its EWMA (Eq. 10) and stability over the last `window` samples (Eq. 11–12)."""

    def __init__(self, smoothing: float = 0.3, window: int = 8) -> None:
        if not 0 < smoothing <= 1 or window < 2:
            raise ValueError(f"need 0 < smoothing <= 1 and window >= 2, got {smoothing}, {window}")
        self.smoothing = smoothing
        self.value: float | None = None
        self.samples: deque[float] = deque(maxlen=window)

    def observe(self, r: float) -> float:
        """Take a sample; returns the smoothed value."""
        self.value = r if self.value is None else self.smoothing * r + (1 - self.smoothing) * self.value
        self.samples.append(r)
        return self.value

    @property
    def stability(self) -> float:
        """S_r(t) = 1 − σ_r/r̂ over the last samples, within [0, 1]; 1 until there are two."""
        if len(self.samples) < 2 or not self.value:
            return 1.0
        sigma = math.sqrt(sum((r - self.value) ** 2 for r in self.samples) / len(self.samples))
        return min(1.0, max(0.0, 1.0 - sigma / abs(self.value)))


@dataclass(frozen=True)
class CacheSizing:
    """Eq. 17's constants. A_m = 0.9: the cache may take nine tenths of what is free beside it (the rest absorbs a
    prompt's activations and what other processes take between two looks); β = 1: an indicator as unsteady as its
    own size (S_m = 0) halves what is taken."""

    allocation: float = 0.9  # A_m
    risk: float = 1.0  # β

    def __post_init__(self) -> None:
        if not 0 < self.allocation <= 1 or self.risk < 0:
            raise ValueError(f"need 0 < A_m <= 1 and β >= 0, got {self.allocation}, {self.risk}")

    def experts(self, available: float, expert_bytes: int, stability: float, total: int, minimum: int = 1) -> int:
        """E'(t): the experts of `expert_bytes` the cache should hold with `available` bytes for it (smoothed) and
        the memory's `stability`; at least `minimum` (the paper's 1; a layer's top-k here), at most `total`."""
        fit = math.floor(self.allocation * max(0.0, available) / (expert_bytes * (1 + self.risk * (1 - stability))))
        return min(max(minimum, fit), total)


def offload_priority(frequency: float, size: int, load_s: float, gamma: float = 0.5) -> float:
    """Eq. 18: γ·f_act + (1 − γ)·s/L_comm — `size` in bytes over `load_s` seconds to load it again (a rate: how
    fast it can be brought back). As printed the second term grows with the link's speed; both terms are
    returned as the paper writes them."""
    if load_s <= 0 or not 0 <= gamma <= 1:
        raise ValueError(f"need a positive load time and 0 <= γ <= 1, got {load_s}, {gamma}")
    return gamma * frequency + (1 - gamma) * size / load_s


@dataclass(frozen=True)
class Choice:
    name: str
    needed: float  # M_req: what running it takes, in the unit `available` is given in — experts (the engine's
    # variant hook: a variant's expert count against E'(t), Eq. 17) or bytes
    quality: float  # P: higher is better (e.g. minus the perplexity change)


@dataclass(frozen=True)
class Switching:
    """Eq. 35's constants: switch when ΔP > λ·C_switch and the state has held for `hold` looks (T_threshold). λ =
    1 with C_switch in the units of P per second of switching (`cost_per_s`); `hold` = 3 looks."""

    weight: float = 1.0  # λ
    hold: int = 3  # T_threshold, in looks

    def best(self, choices: Sequence[Choice], available: float) -> Choice | None:
        """Eq. 34: the highest quality whose M_req fits `available`; None if none fits."""
        fitting = [c for c in choices if c.needed <= available]
        return max(fitting, key=lambda c: (c.quality, -c.needed)) if fitting else None

    def should_switch(self, current: Choice, best: Choice | None, available: float, switch_cost: float,
                      stable_for: int) -> bool:
        """Eq. 35: ΔP(current, best) > λ·C_switch and T_stable > T_threshold. A current choice that no longer fits
        `available` is left at once for the best that does (a departure: Eq. 35 weighs gains; staying where the
        memory is gone means being killed, which no gain outweighs)."""
        if best is None or best == current:
            return False
        if current.needed > available:
            return True
        return best.quality - current.quality > self.weight * switch_cost and stable_for > self.hold
