"""Trained policy parameters beside a model: `<model>/policies/<name>.json`. Read and written here only, and
handed to the policies as plain objects — a policy never opens a file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from moetier.atomic import atomic_write_json
from moetier.cache.keys import ExpertKey
from moetier.cache.policies import LEARNED, EvictionPolicy, PolicyContext, base_name, make_policy
from moetier.cache.policies.flashmoe_ml import CacheModel
from moetier.cache.policies.hobbit import HobbitWeights
from moetier.errors import MoetierError, parsing


def policy_file(model_dir: Path, name: str) -> Path:
    return Path(model_dir) / "policies" / f"{name}.json"


def _train_hint(name: str) -> str:
    return f"`moetier train cache-policy --policy {name} --trace DIR --model M` writes it"


def load_params(name: str, model_dir: Path | None) -> dict:
    """The constructor arguments of learned policy `name` saved with the model; every learned policy is refused
    alike without its file."""
    path = policy_file(model_dir, name) if model_dir else None
    if path is None or not path.exists():
        where = f" ({path} does not exist)" if path else " (no model directory to look in)"
        raise MoetierError(f"{name} is a learned policy and has no trained file for this model{where}",
                           hint=_train_hint(name))
    with parsing(str(path), hint=f"the file is damaged; {_train_hint(name)}"):
        d = json.loads(path.read_bytes())
        if name == "flashmoe-ml":
            return {"model": CacheModel.from_json(d)}
        if name == "hobbit":
            return {"weights": HobbitWeights(**d["weights"])}
        return {"counts": {ExpertKey(int(layer), int(e)): int(n) for layer, e, n in d["counts"]}}


def save_params(name: str, path: Path, params: dict, trained_on: str, **extra) -> None:
    """Write learned policy `name`'s constructor arguments (as `load_params` returns them) to `path`."""
    if name == "flashmoe-ml":
        d = params["model"].to_json()
    elif name == "hobbit":
        d = {"policy": name, "weights": dataclasses.asdict(params["weights"])}
    else:
        d = {"policy": name, "counts": [[k.layer, k.expert, n] for k, n in sorted(params["counts"].items())]}
    atomic_write_json(path, {**d, "trained_on": trained_on, **extra})


def make_policy_for_model(name: str, ctx: PolicyContext, model_dir: Path | None, **params) -> EvictionPolicy:
    """`make_policy`, with a learned policy's parameters read from beside the model unless given."""
    if base_name(name) in LEARNED and not params:
        params = load_params(base_name(name), model_dir)
    return make_policy(name, ctx, **params)


THRESHOLDS = "thresholds"  # policies/thresholds.json: a model's fitted HOBBIT thresholds


def load_thresholds(model_dir: Path | None) -> tuple[float, float] | None:
    """The model's fitted (T1, T2), or None if it has none."""
    path = policy_file(model_dir, THRESHOLDS) if model_dir else None
    if path is None or not path.exists():
        return None
    with parsing(str(path), hint="the file is damaged; `moetier train thresholds --trace DIR --model M` writes it"):
        d = json.loads(path.read_bytes())
        t1, t2 = float(d["t1"]), float(d["t2"])
        if not 0 <= t1 <= t2:
            raise ValueError(f"thresholds need 0 <= T1 <= T2, got {t1}, {t2}")
        return t1, t2


def save_thresholds(path: Path, t1: float, t2: float, trained_on: str, **extra) -> None:
    atomic_write_json(path, {"t1": t1, "t2": t2, "trained_on": trained_on, **extra})


SIMILARITY = "similarity"  # policies/similarity.json: each MoE layer's expert similarity (CoMoE Eq. 27)
_SIMILARITY_HINT = "`moetier train similarity --trace DIR --model M` writes it"


def load_similarity(model_dir: Path | None, moe_layers, num_experts: int) -> dict[int, np.ndarray]:
    """Each MoE layer's [E, E] expert similarity saved with the model; refused without its file."""
    path = policy_file(model_dir, SIMILARITY) if model_dir else None
    if path is None or not path.exists():
        where = f" ({path} does not exist)" if path else " (no model directory to look in)"
        raise MoetierError(f"similar-expert substitution needs the model's expert similarities{where}",
                           hint=_SIMILARITY_HINT)
    with parsing(str(path), hint=f"the file is damaged; {_SIMILARITY_HINT}"):
        d = json.loads(path.read_bytes())
        out = {int(layer): np.asarray(m, dtype=np.float32) for layer, m in d["layers"].items()}
        if set(out) != set(moe_layers) or any(m.shape != (num_experts, num_experts) for m in out.values()):
            raise ValueError(f"need an [{num_experts}, {num_experts}] matrix for each of MoE layers "
                             f"{list(moe_layers)}")
        return out


def save_similarity(path: Path, layers: dict[int, np.ndarray], alpha: float, trained_on: str, **extra) -> None:
    atomic_write_json(path, {"alpha": alpha, "layers": {str(layer): np.round(m, 4).tolist()
                                                        for layer, m in layers.items()},
                             "trained_on": trained_on, **extra})
