"""FlashMoE's learned replacement: per layer, a small feed-forward network reads two features of an expert —
inverse recency 1/r (r: steps since its last use) and frequency f / max f (its uses against its layer's most
used expert's) — and predicts log(1 + steps to its next use); the expert predicted to be needed last is
evicted. Trained on Belady-derived targets from a trace (`moetier train cache-policy --policy flashmoe-ml`);
the networks are handed to the policy (moetier/policy_files.py reads and writes them beside the model)."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

import numpy as np

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.context import PolicyContext
from moetier.cache.policies.scored import ScoredPolicy
from moetier.errors import MoetierError

FEATURES = ("inverse recency 1/r", "frequency f/max f")


def features(step: int, last_step: np.ndarray, count: np.ndarray, max_count: float) -> np.ndarray:
    """[n, 2] features of n experts at `step` (last_step 0 and count 0: never used)."""
    recency = np.where(last_step > 0, 1.0 / np.maximum(step - last_step, 1), 0.0)
    return np.stack([recency, count / max(max_count, 1.0)], axis=1)


@dataclass(frozen=True)
class LayerMLP:
    """features [n, 2] -> predicted log(1 + steps to next use) [n]: one hidden ReLU layer."""

    w1: np.ndarray  # [2, H]
    b1: np.ndarray  # [H]
    w2: np.ndarray  # [H]
    b2: float

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.maximum(x @ self.w1 + self.b1, 0.0) @ self.w2 + self.b2

    def to_json(self) -> dict:
        return {"w1": self.w1.tolist(), "b1": self.b1.tolist(), "w2": self.w2.tolist(), "b2": float(self.b2)}

    @classmethod
    def from_json(cls, d: dict) -> LayerMLP:
        return cls(np.asarray(d["w1"]), np.asarray(d["b1"]), np.asarray(d["w2"]), float(d["b2"]))


@dataclass(frozen=True)
class CacheModel:
    layers: dict[int, LayerMLP]
    trained_on: str = ""

    def to_json(self) -> dict:
        return {"policy": "flashmoe-ml", "features": FEATURES, "target": "log(1 + steps to next use)",
                "trained_on": self.trained_on, "layers": {str(k): v.to_json() for k, v in self.layers.items()}}

    @classmethod
    def from_json(cls, d: dict) -> CacheModel:
        return cls({int(k): LayerMLP.from_json(v) for k, v in d["layers"].items()}, str(d.get("trained_on", "")))


class FlashMoEMLPolicy(ScoredPolicy):
    name = "flashmoe-ml"

    def __init__(self, ctx: PolicyContext, model: CacheModel) -> None:
        super().__init__(ctx)
        missing = sorted(set(ctx.layers) - set(model.layers))
        if missing:
            raise MoetierError(f"flashmoe-ml weights ({model.trained_on}) have no network for layers {missing}")
        self.model = model
        self.last_step = {layer: np.zeros(ctx.num_experts) for layer in ctx.layers}  # [E] per layer
        self.count = {layer: np.zeros(ctx.num_experts) for layer in ctx.layers}

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        super().on_access(key, precision, step)
        self.last_step[key.layer][key.expert] = step
        self.count[key.layer][key.expert] += 1

    def victim(self, candidates: Container[ExpertKey]) -> ExpertKey:
        keys = [k for k in self.resident if k in candidates]
        if not keys:
            raise LookupError("no evictable expert")
        best, best_rank = None, None
        for layer in {k.layer for k in keys}:
            mine = [k for k in keys if k.layer == layer]
            experts = np.fromiter((k.expert for k in mine), dtype=np.int64, count=len(mine))
            x = features(self.step, self.last_step[layer][experts], self.count[layer][experts],
                         float(self.count[layer].max()))
            for key, distance in zip(mine, self.model.layers[layer](x).tolist()):
                rank = (-distance, self.last_use.get(key, 0), key)  # farthest predicted next use first
                if best_rank is None or rank < best_rank:
                    best, best_rank = key, rank
        return best
