"""Trained predictors beside a model: `<model>/predictors/<name>.safetensors` (the networks' weights, one set per
MoE layer, with what they were trained on in the metadata). Read and written here only, and handed to the
predictors as plain objects — a predictor never opens a file. The same folder as the learned cache policies'
(`Store.trained_dir`): beside the store, beside the model it was converted from, or the base of an inflated one."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from moetier.atomic import ordinary_mode
from moetier.errors import MoetierError, parsing
from moetier.predict.comoe_mlp import ComoeNet, multi_hot, running_context
from moetier.predict.comoe_mlp import train_layer as train_comoe_layer
from moetier.predict.llapor import LLaPorNet, TrainConfig, layer_groups, routing_weights
from moetier.predict.llapor import train_layer as train_llapor_layer
from moetier.predictor_names import TRAINED  # noqa: F401  (read here by the engine and the commands)


def predictor_file(model_dir: Path, name: str) -> Path:
    return Path(model_dir) / "predictors" / f"{name}.safetensors"


def _hint(name: str) -> str:
    return f"`moetier train predictor --predictor {name} --trace DIR --model M` writes it"


def _net(name: str, meta: dict, group: str | None) -> torch.nn.Module:
    if name == "llapor":
        return LLaPorNet(meta["hidden"], meta["num_experts"], group)
    return ComoeNet(meta["hidden"], meta["num_experts"])


def load_nets(name: str, model_dir: Path | None) -> dict[int, torch.nn.Module]:
    """The networks of trained predictor `name` saved with the model, by the MoE layer each predicts from."""
    path = predictor_file(model_dir, name) if model_dir else None
    if path is None or not path.exists():
        where = f" ({path} does not exist)" if path else " (no model directory to look in)"
        raise MoetierError(f"{name} is a trained predictor and has no trained file for this model{where}",
                           hint=_hint(name))
    try:
        with safe_open(path, "pt") as f:
            meta = json.loads((f.metadata() or {})["moetier"])
        tensors = load_file(path)
    except (OSError, KeyError, ValueError, SafetensorError) as e:
        raise MoetierError(f"{path}: not a trained predictor file ({e})", hint=_hint(name)) from None
    with parsing(str(path), hint=f"the file is damaged; {_hint(name)}"):
        nets = {}
        for layer, group in ((int(k), v) for k, v in meta["groups"].items()):
            net = _net(name, meta, group)
            mine = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.split(".", 1)[0] == str(layer)}
            try:
                net.load_state_dict(mine)
            except RuntimeError as e:  # missing or misshapen weights
                raise ValueError(str(e).splitlines()[0]) from None
            nets[layer] = net.eval()
    return nets


def save_nets(name: str, path: Path, nets: dict[int, torch.nn.Module], meta: dict) -> None:
    """Write the networks (in float16: half the bytes a model ships; the scores move in their last bits) through a
    temporary file renamed into place."""
    tensors = {f"{layer}.{k}": v.detach().to(torch.float16).contiguous() for layer, net in nets.items()
               for k, v in net.state_dict().items()}
    meta = {**meta, "predictor": name,
            "groups": {str(layer): getattr(net, "group", None) for layer, net in nets.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, tmp, metadata={"moetier": json.dumps(meta)})
        os.chmod(tmp, ordinary_mode())  # (safetensors writes 0600)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def train_nets(name: str, gate_inputs: np.ndarray, topk_ids: np.ndarray, topk_weights: np.ndarray, seq: np.ndarray,
               layers: list[int], num_experts: int, epochs: int = 30,
               progress: Callable[[int], None] | None = None) -> dict[int, torch.nn.Module]:
    """One network per MoE layer but the last, each on the layer's rows [N, ...] and the next layer's choices."""
    nets = {}
    groups = layer_groups(layers)
    for j, layer in enumerate(layers[:-1]):
        hidden = torch.from_numpy(gate_inputs[:, j].astype(np.float32))
        chosen = multi_hot(topk_ids[:, j + 1], num_experts)  # the next layer's experts
        if name == "llapor":
            weights = routing_weights(topk_ids[:, j], topk_weights[:, j], num_experts)
            nets[layer] = train_llapor_layer(hidden, weights, chosen, groups[layer], TrainConfig(epochs=epochs))
        else:
            target = chosen / chosen.sum(-1, keepdim=True)
            nets[layer] = train_comoe_layer(multi_hot(topk_ids[:, j], num_experts), hidden,
                                            running_context(hidden, seq), target, epochs=epochs)
        if progress:
            progress(1)
    return nets
