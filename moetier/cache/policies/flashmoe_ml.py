"""FlashMoE's learned replacement (§3.2, Algorithm 1, Table 1): per layer, a feed-forward network reads two
features of an expert — inverse recency 1/r (r: steps since its last use) and frequency f / max f (its uses
against its layer's most used expert's) — and predicts its routing distance, the steps to its next use; the expert
predicted to be needed last is evicted. Table 1's network: three hidden layers of 128 with SiLU, trained by MSE
with AdamW (lr 1e-3, weight decay 1e-2) on Belady-derived targets from a trace, epochs with early stopping
(`moetier train cache-policy --policy flashmoe-ml`, moetier/sim/fit.py); the networks are handed to the policy
(moetier/policy_files.py reads and writes them beside the model).

The distance target is log(1 + steps to next use) — a departure: FlashMoE names a distance without its scale;
on raw steps the squared error is all in the never-used-again tail and the near ranking, which decides evictions,
is lost (see docs/cache-policies.md for the two measured side by side).

Every expert's distance is predicted as an array [L, E] (ArrayScoredPolicy), the layers' networks stacked into one
batched product, and kept until its features change — a new step (every expert's recency) or a use (its layer's
counts): a decode token's evictions cost one prediction of every layer and one of each layer as it runs, where each
victim ran every layer's network over its residents (~1 ms a victim; 90 ms a token against CoMoE's 34 at demo-deep's
15%). The victim is the same: farthest predicted next use, then least recently used, then key order."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies.arrayed import ArrayScoredPolicy
from moetier.cache.policies.context import PolicyContext
from moetier.errors import MoetierError

FEATURES = ("inverse recency 1/r", "frequency f/max f")


def features(step: int, last_step: np.ndarray, count: np.ndarray, max_count: float | np.ndarray) -> np.ndarray:
    """[..., n, 2] features of n experts at `step` (last_step 0 and count 0: never used); `max_count` a number, or
    [..., 1] for rows of several layers."""
    recency = np.where(last_step > 0, 1.0 / np.maximum(step - last_step, 1), 0.0)
    return np.stack([recency, count / np.maximum(max_count, 1.0)], axis=-1)


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


class FlashMoEMLPolicy(ArrayScoredPolicy):
    name = "flashmoe-ml"

    def __init__(self, ctx: PolicyContext, model: CacheModel) -> None:
        super().__init__(ctx)
        missing = sorted(set(ctx.layers) - set(model.layers))
        if missing:
            raise MoetierError(f"flashmoe-ml weights ({model.trained_on}) have no network for layers {missing}")
        self.model = model
        self.networks = [model.layers[layer] for layer in ctx.layers]  # rows in execution order
        self.stacked = stack(self.networks)
        shape = (len(ctx.layers), ctx.num_experts)
        self.last_step, self.count = np.zeros(shape), np.zeros(shape)  # [L, E] each
        self.distance = np.zeros(shape)  # [L, E] predicted at step `predicted_at`, but in the rows of `stale`
        self.predicted_at: int | None = None
        self.stale: set[int] = set()

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        super().on_access(key, precision, step)
        row = self.row[key.layer]
        self.last_step[row, key.expert] = step
        self.count[row, key.expert] += 1
        self.stale.add(row)

    def predict(self, rows: np.ndarray) -> np.ndarray:
        """[R, E] what the networks of `rows` predict for every expert of their layers at the current step."""
        count = self.count[rows]  # [R, E]
        x = features(self.step, self.last_step[rows], count, count.max(axis=1, keepdims=True))  # [R, E, 2]
        if self.stacked is None:  # networks of different shapes: one product each
            return np.stack([self.networks[row](x[i]) for i, row in enumerate(rows)])
        weights, biases = self.stacked
        for i, (w, b) in enumerate(zip(weights, biases)):
            x = np.matmul(x, w[rows]) + b[rows]  # [R, E, out]: each row's layer by its own network
            if i < len(weights) - 1:
                x = silu(x)
        return x[..., 0]

    def fresh_distances(self) -> np.ndarray:
        """[L, E] every expert's predicted distance to its next use, predicted again where its features changed."""
        if self.predicted_at != self.step:
            self.stale = set(range(len(self.ctx.layers)))
        if self.stale:
            rows = np.fromiter(sorted(self.stale), np.int64, len(self.stale))
            self.distance[rows] = self.predict(rows)
            self.stale.clear()
            self.predicted_at = self.step
        return self.distance

    def priorities(self) -> np.ndarray:
        return -self.fresh_distances()  # farthest predicted next use first

    def priority(self, key: ExpertKey) -> float:
        return float(self.priorities()[self.row[key.layer], key.expert])


def stack(networks: list[LayerMLP]) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]] | None:
    """The networks' weights [L, in, out] and biases [L, 1, out], one array a linear layer, for one batched product
    over layers; None where their shapes differ."""
    if len({tuple(w.shape for w in net.weights) for net in networks}) != 1:
        return None
    depth = len(networks[0].weights)
    return (tuple(np.stack([net.weights[i] for net in networks]) for i in range(depth)),
            tuple(np.stack([net.biases[i][None, :] for net in networks]) for i in range(depth)))
