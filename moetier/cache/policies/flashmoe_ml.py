"""FlashMoE's learned replacement (§3.2, Algorithm 1, Table 1): per layer, a feed-forward network reads two
features of an expert — inverse recency 1/r (r: steps since its last use) and frequency f / max f (its uses
against its layer's most used expert's) — and predicts its routing distance, the steps to its next use; the expert
predicted to be needed last is evicted. Table 1's network: three hidden layers of 128 with SiLU, trained by MSE
with AdamW (lr 1e-3, weight decay 1e-2) on Belady-derived targets from a trace, epochs with early stopping
(`moetier train cache-policy --policy flashmoe-ml`, moetier/sim/fit.py); the networks are handed to the policy
(moetier/policy_files.py reads and writes them beside the model).

The distance target is log(1 + steps to next use) — a departure: FlashMoE names a distance without its scale;
on raw steps the squared error is all in the never-used-again tail and the near ranking, which decides evictions,
is lost (see docs/cache-policies.md for the two measured side by side)."""

from __future__ import annotations

import base64
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


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


@dataclass(frozen=True)
class LayerMLP:
    """features [n, 2] -> predicted distance to next use [n]: linear layers with SiLU between (Table 1: 2 -> 128
    -> 128 -> 128 -> 1). Evaluated in NumPy: a victim choice scores a few hundred experts (~0.1 ms a layer)."""

    weights: tuple[np.ndarray, ...]  # [in, out] each
    biases: tuple[np.ndarray, ...]  # [out] each

    def __post_init__(self) -> None:
        shapes = [w.shape for w in self.weights]
        if not shapes or shapes[0][0] != len(FEATURES) or shapes[-1][1] != 1 or len(self.biases) != len(shapes) \
                or any(a[1] != b[0] for a, b in zip(shapes, shapes[1:])) \
                or any(b.shape != (w.shape[1],) for w, b in zip(self.weights, self.biases)):
            raise ValueError(f"a flashmoe-ml network must chain {len(FEATURES)} features to 1 output; got layers "
                             f"{shapes} with biases {[b.shape for b in self.biases]}")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            x = x @ w + b
            if i < len(self.weights) - 1:
                x = silu(x)
        return x[:, 0]

    def to_json(self) -> dict:
        """Arrays as base64 of float16 (a 2-128-128-128-1 network is 33,537 numbers: 67 KB so, ~700 KB as
        decimal text; a ranking network does not feel the rounding)."""
        return {"weights": [pack(w) for w in self.weights], "biases": [pack(b) for b in self.biases],
                "activation": "silu"}

    @classmethod
    def from_json(cls, d: dict) -> LayerMLP:
        if "weights" not in d:
            raise MoetierError("this flashmoe-ml file holds the earlier one-hidden-layer network",
                               hint="train it again with `moetier train cache-policy --policy flashmoe-ml`")
        return cls(tuple(unpack(w) for w in d["weights"]), tuple(unpack(b) for b in d["biases"]))


def pack(a: np.ndarray) -> dict:
    return {"shape": list(a.shape), "float16": base64.b64encode(a.astype("<f2").tobytes()).decode("ascii")}


def unpack(d: dict) -> np.ndarray:
    data = np.frombuffer(base64.b64decode(d["float16"], validate=True), dtype="<f2")
    return data.reshape(d["shape"]).astype(np.float64)


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
