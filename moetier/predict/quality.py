"""How good a prediction is, one definition each (DESIGN.md's measures):

- **recall**: of the true top-k experts of each token, the share among the predicted top-k;
- **Top-4-within-Top-6** (PreScope §5, Table 3): experts ranked by the tokens routed to them in the step (ties
  by summed router score); the share of the predicted four hottest that are among the true six hottest. At
  batch 1 every selected expert has one token and the ranking is by router score."""

from __future__ import annotations

import numpy as np


def top_ids(scores: np.ndarray, k: int) -> np.ndarray:
    """[T, E] -> [T, k] the k highest per row, highest first (ties to the lower id)."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def recall(predicted: np.ndarray, true_ids: np.ndarray) -> float:
    """predicted scores [T, E], true_ids [T, k] -> the share of true (token, expert) pairs in the predicted top-k."""
    k = true_ids.shape[1]
    guess = top_ids(predicted, k)  # [T, k]
    return float((guess[:, :, None] == true_ids[:, None, :]).any(1).mean())


def hottest(volume: np.ndarray, tiebreak: np.ndarray, n: int) -> np.ndarray:
    """The n experts of largest volume [E], ties by the larger tiebreak [E], then the lower id."""
    order = np.lexsort((np.arange(volume.size), -tiebreak, -volume))
    return order[:n]


def top4_within_top6(predicted: np.ndarray, true_ids: np.ndarray, true_scores: np.ndarray,
                     predicted_n: int = 4, true_n: int = 6) -> float:
    """predicted [T, E]; true_ids [T, k] and true_scores [T, E] of the step -> share of the predicted hottest
    `predicted_n` among the true hottest `true_n`."""
    num_experts = true_scores.shape[1]
    k = true_ids.shape[1]
    true_volume = np.bincount(true_ids.ravel(), minlength=num_experts)
    picked = top_ids(predicted, k)
    predicted_volume = np.bincount(picked.ravel(), minlength=num_experts)
    truth = set(hottest(true_volume, true_scores.sum(0), true_n).tolist())
    guess = hottest(predicted_volume, predicted.sum(0), predicted_n).tolist()
    return sum(e in truth for e in guess) / len(guess)
