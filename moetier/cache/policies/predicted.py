"""`NAME+predicted`: any policy, told by the predictor what the coming layers will need (DESIGN.md's
`on_predict`): those experts are its last victims. In a cache shared by all layers the experts of the next layers
were used one step ago — the least recent of all — so recency alone evicts exactly what is about to be needed;
a prediction of the next layers' top-k removes them from the victims while anything else is evictable. The
wrapped policy hears every event as before and chooses among the rest."""

from __future__ import annotations

from collections.abc import Container

import numpy as np

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.base import EvictionPolicy

SUFFIX = "+predicted"


class _Unprotected:
    """The candidates, less the protected keys."""

    def __init__(self, candidates: Container[ExpertKey], protected: frozenset[ExpertKey]) -> None:
        self.candidates, self.protected = candidates, protected

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self.candidates and key not in self.protected


class PredictedPolicy(EvictionPolicy):
    def __init__(self, base: EvictionPolicy, top_k: int) -> None:
        self.base, self.top_k = base, top_k
        self.name = base.name + SUFFIX
        self.protected: frozenset[ExpertKey] = frozenset()  # each token's predicted top-k, every coming layer

    def start_set(self) -> tuple[ExpertKey, ...]:
        return self.base.start_set()

    def on_sequence_start(self) -> None:
        self.protected = frozenset()
        self.base.on_sequence_start()

    def on_route(self, route) -> None:
        self.base.on_route(route)

    def on_predict(self, predictions) -> None:
        """{layer: scores [T, E]}: the latest prediction replaces the last (it names the layers still to come)."""
        self.base.on_predict(predictions)
        keys = set()
        for layer, scores in predictions.items():
            k = min(self.top_k, scores.shape[1])
            top = np.argpartition(-scores, k - 1, axis=1)[:, :k]  # [T, k], unordered
            keys.update(ExpertKey(layer, int(e)) for e in np.unique(top))
        self.protected = frozenset(keys)

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        self.base.on_access(key, precision, step)

    def on_insert(self, key: ExpertKey) -> None:
        self.base.on_insert(key)

    def on_evict(self, key: ExpertKey) -> None:
        self.base.on_evict(key)

    def victim(self, candidates: Container[ExpertKey]) -> ExpertKey:
        if self.protected:
            try:
                return self.base.victim(_Unprotected(candidates, self.protected))
            except LookupError:  # every evictable key is predicted: the base policy's choice among them
                pass
        return self.base.victim(candidates)
