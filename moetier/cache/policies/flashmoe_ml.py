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

The residents' distances are predicted as an array [L, E] (ArrayScoredPolicy), the layers' networks stacked into
one batched product over each layer's residents, and kept until their features change — a new step (every expert's
recency) or a use (its layer's counts) — or a resident inserted since may be a victim: a decode token's evictions
cost one prediction of every layer and about one of each layer as it runs, where each victim ran every layer's
network over its residents (demo-deep at 15%, Zen 4: 77–126 ms a token against 36–48 for the arrays over all
experts, alternated; 26.5 ms now, LRU's 29.6 — docs/cache-policies.md). The victim is the same: farthest predicted
next use, then least recently used, then key order (tests/cache/test_array_victim.py holds it to the networks run
at each victim)."""

from __future__ import annotations

import base64
from collections.abc import Collection, Container
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
    with np.errstate(over="ignore"):  # exp(-x) is inf below x = -88 in float32: x / inf = -0, silu's limit
        return x / (1.0 + np.exp(-x))


@dataclass(frozen=True)
class LayerMLP:
    """features [n, 2] -> predicted distance to next use [n]: linear layers with SiLU between (Table 1: 2 -> 128
    -> 128 -> 128 -> 1). Evaluated in NumPy in float32, a layer's network alone here; the policy runs the layers'
    networks stacked (`stack`): demo-deep's twelve layers over 32 residents each 0.39 ms on a Zen 4 (0.75 in
    float64)."""

    weights: tuple[np.ndarray, ...]  # [in, out] each
    biases: tuple[np.ndarray, ...]  # [out] each

    def __post_init__(self) -> None:
        shapes = [w.shape for w in self.weights]
        if not shapes or shapes[0][0] != len(FEATURES) or shapes[-1][1] != 1 or len(self.biases) != len(shapes) \
                or any(a[1] != b[0] for a, b in zip(shapes, shapes[1:])) \
                or any(b.shape != (w.shape[1],) for w, b in zip(self.weights, self.biases)):
            raise ValueError(f"a flashmoe-ml network must chain {len(FEATURES)} features to 1 output; got layers "
                             f"{shapes} with biases {[b.shape for b in self.biases]}")
        # float32, as it was trained (torch's Linear) and as its file keeps it (float16): in float64 the products were
        # twice the work for digits the file never had (a 50% cache of demo-deep: a token's first eviction predicts
        # every layer's residents)
        object.__setattr__(self, "weights", tuple(w.astype(np.float32) for w in self.weights))
        object.__setattr__(self, "biases", tuple(b.astype(np.float32) for b in self.biases))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float32, copy=False)
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
    return data.reshape(d["shape"]).astype(np.float32)


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
        self.distance = np.zeros(shape)  # [L, E] the residents' predicted at step `predicted_at`, but in `stale`
        self.predicted_at: int | None = None
        self.unscored = np.zeros(shape, dtype=bool)  # [L, E] residents inserted since their row was predicted
        self.stale: set[int] = set()

    def on_access(self, key: ExpertKey, precision: Precision, step: int) -> None:
        super().on_access(key, precision, step)
        row = self.row[key.layer]
        self.last_step[row, key.expert] = step
        self.count[row, key.expert] += 1
        self.stale.add(row)

    def on_insert(self, key: ExpertKey) -> None:
        super().on_insert(key)
        self.unscored[self.row[key.layer], key.expert] = True  # predicted once it may be a victim (`settle`)

    def settle(self, candidates: Container[ExpertKey]) -> None:
        """Rows holding a resident inserted since they were last predicted, where it is a candidate now, made
        stale: a layer's loads each insert one, and the layer's own are no candidates while it runs (a prediction
        a load would cost as much again as the victim it made room for)."""
        for i in np.flatnonzero(self.unscored):  # [U] a layer's few loads at most
            if self.keys[i] in candidates:
                self.stale.add(int(i) // self.ctx.num_experts)

    def victim(self, candidates: Container[ExpertKey]) -> ExpertKey:
        self.settle(candidates)
        return super().victim(candidates)

    def victim_among(self, keys: Collection[ExpertKey]) -> ExpertKey:
        self.settle(set(keys))
        return super().victim_among(keys)

    def predict(self, rows: np.ndarray) -> None:
        """Into `distance`: what the networks of `rows` predict at the current step for their layers' residents —
        the only experts a victim is chosen from — and as many others as the row with most residents has (a
        product's rows are padded to one width: a 15% cache's ~10 of 64 experts a layer, not all 64)."""
        held = self.held[rows]  # [R, E]
        width = int(held.sum(axis=1).max())
        if width == 0:
            return
        experts = np.argsort(~held, axis=1, kind="stable")[:, :width]  # [R, W] each row's residents first
        count = self.count[rows]  # [R, E]
        x = features(self.step, np.take_along_axis(self.last_step[rows], experts, 1),
                     np.take_along_axis(count, experts, 1),
                     count.max(axis=1, keepdims=True)).astype(np.float32)  # [R, W, 2], as the networks' weights
        if self.stacked is None:  # networks of different shapes: one product each
            distance = np.stack([self.networks[row](x[i]) for i, row in enumerate(rows)])
        else:
            weights, biases = self.stacked
            for i, (w, b) in enumerate(zip(weights, biases)):
                x = np.matmul(x, w[rows]) + b[rows]  # [R, W, out]: each row's layer by its own network
                if i < len(weights) - 1:
                    x = silu(x)
            distance = x[..., 0]
        self.distance[rows[:, None], experts] = distance  # [R, W]
        self.unscored[rows] = False

    def fresh_distances(self) -> np.ndarray:
        """[L, E] the residents' predicted distances to their next use (others' may be old), predicted again where
        their features changed."""
        if self.predicted_at != self.step:
            self.stale = set(range(len(self.ctx.layers)))
        if self.stale:
            self.predict(np.fromiter(sorted(self.stale), np.int64, len(self.stale)))
            self.stale.clear()
            self.predicted_at = self.step
        return self.distance

    def priorities(self) -> np.ndarray:
        return -self.fresh_distances()  # farthest predicted next use first

    def priority(self, key: ExpertKey) -> float:
        """A resident's (a victim is only ever a resident)."""
        return float(self.priorities()[self.row[key.layer], key.expert])


def stack(networks: list[LayerMLP]) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]] | None:
    """The networks' weights [L, in, out] and biases [L, 1, out], one array a linear layer, for one batched product
    over layers; None where their shapes differ."""
    if len({tuple(w.shape for w in net.weights) for net in networks}) != 1:
        return None
    depth = len(networks[0].weights)
    return (tuple(np.stack([net.weights[i] for net in networks]) for i in range(depth)),
            tuple(np.stack([net.biases[i][None, :] for net in networks]) for i in range(depth)))
