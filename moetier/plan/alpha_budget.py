"""α under a TPOT budget (SMoE §V-C, Eq. 5): min_α A(α) s.t. T(α) ≤ R. A larger α substitutes more and loses more
accuracy, so the answer is the smallest α whose TPOT meets the budget R. T(α) is fitted with a low-degree
polynomial to TPOTs measured at a few α (a short calibration run: the caller's `measure`), then searched on a fine
grid. Pure logic: the engine supplies the measurements (moetier/engine/engine.py, `tune_substitution`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

CALIBRATION_ALPHAS = (0.0, 0.15, 0.3, 0.45, 0.6)  # Table IV's range, 0 to 0.6
DEGREE = 2  # "a low-degree polynomial": the paper finds T(α) about linear (Fig. 10); 2 allows the bend at the ends
SEARCH_STEP = 0.01


@dataclass(frozen=True)
class AlphaChoice:
    alpha: float
    budget_s: float
    predicted_s: float  # T(α) of the fit at the chosen α
    met: bool  # whether the fit meets the budget at some α in the calibrated range
    measured: tuple[tuple[float, float], ...]  # (α, TPOT s) of the calibration
    coefficients: tuple[float, ...]  # of T(α), highest power first (numpy.polyfit's order)

    def describe(self) -> str:
        points = ", ".join(f"{a:g}: {t * 1e3:.1f}" for a, t in self.measured)
        head = f"TPOT budget {self.budget_s * 1e3:.1f} ms: "
        if self.met:
            return (f"{head}substitution alpha {self.alpha:.2f} (fitted TPOT {self.predicted_s * 1e3:.1f} ms; "
                    f"measured ms at alpha {points})")
        return (f"{head}cannot be met — the fastest alpha calibrated ({self.alpha:.2f}) gives "
                f"{self.predicted_s * 1e3:.1f} ms, {(self.predicted_s - self.budget_s) * 1e3:.1f} ms "
                f"({self.predicted_s / self.budget_s - 1:.0%}) over; running at it (measured ms at alpha {points})")


def fit_tpot(alphas: Sequence[float], tpots: Sequence[float], degree: int = DEGREE) -> np.ndarray:
    """T(α)'s coefficients (highest power first), of a degree the points can carry."""
    degree = min(degree, len(set(alphas)) - 1)
    if degree < 0:
        raise ValueError("need at least one calibration point")
    return np.polyfit(np.asarray(alphas, float), np.asarray(tpots, float), degree)


def choose_alpha(measure: Callable[[float], float], budget_s: float,
                 alphas: Sequence[float] = CALIBRATION_ALPHAS, degree: int = DEGREE) -> AlphaChoice:
    """The smallest α in [min(alphas), max(alphas)] whose fitted TPOT is at most `budget_s`; if none, the α of the
    smallest fitted TPOT, flagged not met. `measure(α)`: a TPOT in seconds measured at α."""
    if budget_s <= 0:
        raise ValueError(f"a TPOT budget must be positive, not {budget_s}")
    measured = tuple((float(a), float(measure(a))) for a in alphas)
    coef = fit_tpot([a for a, _ in measured], [t for _, t in measured], degree)
    grid = np.arange(min(alphas), max(alphas) + SEARCH_STEP / 2, SEARCH_STEP)
    predicted = np.polyval(coef, grid)
    ok = np.flatnonzero(predicted <= budget_s)
    i = int(ok[0]) if ok.size else int(np.argmin(predicted))
    return AlphaChoice(round(float(grid[i]), 4), budget_s, float(predicted[i]), bool(ok.size), measured,
                       tuple(float(c) for c in coef))
