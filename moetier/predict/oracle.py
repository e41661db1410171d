"""`oracle`: the true routing of the coming layers, read from a recorded trace of the same run, with an optional
injected error rate — the bound every prefetcher is measured against (a perfect predictor), and how much a
prefetcher loses as its predictor gets worse. Handed a lookup of the truth; it reads no trace itself."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from moetier.predict.base import Predictions, Predictor

if TYPE_CHECKING:  # the routing is handed in; predictors import nothing above them
    from moetier.plan.route import RouteResult

TrueRoutes = Callable[[int, int], np.ndarray]  # (forward step, layer) -> topk_ids [T, k] of that step


class OraclePredictor(Predictor):
    name = "oracle"

    def __init__(self, moe_layers: Sequence[int], num_experts: int, top_k: int, truth: TrueRoutes,
                 distance: int = 1, error_rate: float = 0.0, seed: int = 0) -> None:
        """error_rate: the chance that each true (token, expert) pair is replaced by an expert the token does
        not use, drawn uniformly."""
        super().__init__(moe_layers, num_experts, top_k, distance)
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be within [0, 1], not {error_rate}")
        if error_rate and num_experts < 2 * top_k:
            raise ValueError(f"injecting errors needs at least 2 top_k = {2 * top_k} experts to draw wrong ones "
                             f"from, not {num_experts}")
        self.truth, self.error_rate = truth, error_rate
        self.rng = np.random.default_rng(seed)
        self.step = 0

    def observe(self, layer: int, gate_input, route: RouteResult) -> None:
        self.step = route.step

    def predict(self, layer: int, gate_input) -> Predictions:
        return {f: self._scores(self.truth(self.step, f)) for f in self.future_layers(layer)}

    def _scores(self, true_ids: np.ndarray) -> np.ndarray:
        """[T, k] -> [T, E]: k for the first routed expert down to 1 for the last (the router's order kept), 0
        elsewhere; with errors, some pairs moved to experts the token does not use."""
        tokens, k = true_ids.shape
        ids = true_ids.astype(np.int64).copy()
        if self.error_rate:
            for t, j in zip(*np.nonzero(self.rng.random((tokens, k)) < self.error_rate)):
                wrong = np.setdiff1d(np.arange(self.num_experts), np.union1d(true_ids[t], ids[t]))
                ids[t, j] = self.rng.choice(wrong)  # neither a true expert nor one the row already names
        scores = np.zeros((tokens, self.num_experts), np.float32)
        np.put_along_axis(scores, ids, np.arange(k, 0, -1, dtype=np.float32)[None, :].repeat(tokens, 0), axis=1)
        return scores
