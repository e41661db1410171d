"""`llapor`: PreScope's Learnable Layer-Aware Predictor (§4.2) — one small network per MoE layer predicting the next
layer's experts from the current layer's router input, compressed by PCA, and the experts the current layer chose
with their routing weights.

As the paper builds it (§4.2.1–4.2.2):
- layer groups: the first and last quarter of the MoE layers are the input and output groups, the rest middle;
- features: the hidden state through PCA (4096 → 256 in the input/output groups, → 512 in the middle: 1/16 and 1/8
  of the width, here at least 32 and 64 components), concatenated with the current layer's routing weights over
  all experts (zero for the unchosen);
- a linear block is Linear → GELU → Dropout; input/output predictors are shallow (one block and a head), middle
  ones add a residual block of two linear blocks, modulated by a sigmoid gating unit on the hidden state;
- input/output predictors train on L = L_expert + λ·L_focal (BCE weighted by inverse expert frequency, plus a
  focal term, γ = 2, λ = 1); middle ones on BCE; AdamW, input/output with 5 warm-up epochs then cosine annealing,
  middle with a higher learning rate and weight decay; Gaussian noise and random masking of the features while
  training; 30 epochs;
- online: the predictor keeps learning while it runs, one gradient step per `online_every` decode tokens of each
  layer, on what the next layer then chose.

It predicts one layer ahead (PreScope's look-ahead is the next layer); `distance` above 1 is not used. Scores are
sigmoid probabilities, one per expert. Departures: the group boundaries and component counts for widths below
4096 are ours (the paper states Mixtral's), and the layer-dependent learning rates are the two settings below."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from moetier.predict.base import Predictions, Predictor

INPUT, MIDDLE, OUTPUT = "input", "middle", "output"


def layer_groups(moe_layers: Sequence[int]) -> dict[int, str]:
    """The first and last quarter of the MoE layers (at least one each) are the input and output groups."""
    n = len(moe_layers)
    edge = max(1, n // 4)
    return {layer: INPUT if i < edge else OUTPUT if i >= n - edge else MIDDLE for i, layer in enumerate(moe_layers)}


def components(hidden: int, group: str) -> int:
    """PCA components: 1/16 of the width near input and output, 1/8 in the middle (4096 → 256 / 512)."""
    return min(hidden, max(32, hidden // 16) if group != MIDDLE else max(64, hidden // 8))


class Block(nn.Sequential):
    def __init__(self, d_in: int, d_out: int, dropout: float) -> None:
        super().__init__(nn.Linear(d_in, d_out), nn.GELU(), nn.Dropout(dropout))


class LLaPorNet(nn.Module):
    """[T, H] hidden, [T, E] routing weights -> [T, E] logits of the next layer's experts."""

    def __init__(self, hidden: int, num_experts: int, group: str, width: int = 256, dropout: float = 0.1) -> None:
        super().__init__()
        self.group = group
        d = components(hidden, group)
        self.register_buffer("pca_mean", torch.zeros(hidden))
        self.register_buffer("pca", torch.zeros(d, hidden))  # [d, H]: the principal directions
        self.block = Block(d + num_experts, width, dropout)
        if group == MIDDLE:
            self.residual = nn.Sequential(Block(width, width, dropout), Block(width, width, dropout))
            self.gate = nn.Linear(d, width)  # the gating unit: how much the hidden state lets the residual in
        self.head = nn.Linear(width, num_experts)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden - self.pca_mean) @ self.pca.T  # [T, d]

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, noise: float = 0.0) -> torch.Tensor:
        z = self.features(hidden)
        x = torch.cat([z, weights], dim=-1)
        if noise:  # Gaussian noise and random masking of the features (§4.2.2), while training only
            x = (x + noise * torch.randn_like(x)) * (torch.rand_like(x) > 0.1)
        h = self.block(x)
        if self.group == MIDDLE:
            h = h + torch.sigmoid(self.gate(z)) * self.residual(h)
        return self.head(h)


def fit_pca(x: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [H], top-d principal directions [d, H]) of the rows of x [N, H]."""
    mean = x.mean(0)
    _, _, v = torch.linalg.svd(x - mean, full_matrices=False)
    out = torch.zeros(d, x.shape[1])
    out[:min(d, v.shape[0])] = v[:d]
    return mean, out


def routing_weights(topk_ids: np.ndarray, topk_weights: np.ndarray, num_experts: int) -> torch.Tensor:
    """[T, k] ids and weights -> [T, E] weight of each expert (zero where unchosen)."""
    w = np.zeros((topk_ids.shape[0], num_experts), np.float32)
    np.put_along_axis(w, topk_ids.astype(np.int64), topk_weights.astype(np.float32), axis=1)
    return torch.from_numpy(w)


def llapor_loss(logits: torch.Tensor, target: torch.Tensor, group: str, inv_freq: torch.Tensor,
                gamma: float = 2.0, lam: float = 1.0) -> torch.Tensor:
    """Input/output groups: L_expert + λ·L_focal (§4.2.2); the middle group: BCE."""
    bce = nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="none")  # −log-likelihood
    if group == MIDDLE:
        return bce.mean()
    p = torch.sigmoid(logits)
    p_t = target * p + (1 - target) * (1 - p)
    return (bce * inv_freq).mean() + lam * ((1 - p_t) ** gamma * bce).mean()


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 30
    batch: int = 256
    lr: float = 1e-3  # input/output groups; the middle group gets `middle_lr`
    weight_decay: float = 1e-2
    middle_lr: float = 3e-3
    middle_weight_decay: float = 5e-2
    warmup_epochs: int = 5
    noise: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch < 1 or self.lr <= 0 or self.middle_lr <= 0:
            raise ValueError("epochs and batch must be at least 1, learning rates positive")


def train_layer(hidden: torch.Tensor, weights: torch.Tensor, target: torch.Tensor, group: str,
                cfg: TrainConfig = TrainConfig()) -> LLaPorNet:
    """One predictor: `hidden` [N, H] and `weights` [N, E] of a layer, `target` [N, E] the next layer's choices."""
    torch.manual_seed(cfg.seed)
    net = LLaPorNet(hidden.shape[1], target.shape[1], group)
    net.pca_mean, net.pca = fit_pca(hidden, net.pca.shape[0])
    freq = target.mean(0).clamp_min(1.0 / len(target))
    inv_freq = (1 / freq) / (1 / freq).mean()  # 1/f_i, normalised to mean 1
    middle = group == MIDDLE
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.middle_lr if middle else cfg.lr,
                            weight_decay=cfg.middle_weight_decay if middle else cfg.weight_decay)
    if middle:
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.epochs)
    else:
        warm = max(1, min(cfg.warmup_epochs, cfg.epochs - 1))
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [
            torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, warm),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, cfg.epochs - warm))], [warm])
    g = torch.Generator().manual_seed(cfg.seed)
    net.train()
    for _ in range(cfg.epochs):
        for idx in torch.randperm(len(hidden), generator=g).split(cfg.batch):
            loss = llapor_loss(net(hidden[idx], weights[idx], cfg.noise), target[idx], group, inv_freq)
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()
    return net.eval()


class LLaPorPredictor(Predictor):
    name = "llapor"

    def __init__(self, moe_layers: Sequence[int], num_experts: int, top_k: int, nets: Mapping[int, LLaPorNet],
                 distance: int = 1, online_every: int = 32, online_lr: float = 1e-4) -> None:
        """nets: for each MoE layer but the last, the network predicting the next one. `online_every`: decode
        tokens of a layer between two online gradient steps (0: never)."""
        super().__init__(moe_layers, num_experts, top_k, distance)
        missing = [layer for layer in self.moe_layers[:-1] if layer not in nets]
        if missing:
            raise ValueError(f"no LLaPor network for layers {missing}")
        self.nets = dict(nets)
        self.online_every = online_every
        self.opts = {layer: torch.optim.AdamW(net.parameters(), lr=online_lr) for layer, net in self.nets.items()} \
            if online_every else {}
        self._weights: dict[int, torch.Tensor] = {}  # layer -> [T, E] its routing weights, this step
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # next layer -> (hidden, weights) fed
        self._samples: dict[int, list] = {}  # predictor layer -> [(hidden, weights, target)] awaiting a step

    def observe(self, layer: int, gate_input, route) -> None:
        weights = routing_weights(route.topk_ids, route.topk_weights, self.num_experts)
        self._weights[layer] = weights
        fed = self._pending.pop(layer, None)
        if fed is not None and self.online_every and fed[0].shape[0] == weights.shape[0]:
            self._learn(self.moe_layers[self._index[layer] - 1], *fed, (weights > 0).float())

    def predict(self, layer: int, gate_input) -> Predictions:
        net = self.nets.get(layer)
        if net is None or gate_input is None:
            return {}
        hidden = torch.as_tensor(gate_input).float().cpu()  # [T, H]: on a GPU, a copy to the host here
        weights = self._weights[layer]
        nxt = self.moe_layers[self._index[layer] + 1]
        if self.online_every and hidden.shape[0] == 1:  # decode tokens teach it once the next layer routes
            self._pending[nxt] = (hidden, weights)
        with torch.no_grad():
            return {nxt: torch.sigmoid(net(hidden, weights)).numpy()}

    def _learn(self, layer: int, hidden, weights, target) -> None:
        samples = self._samples.setdefault(layer, [])
        samples.append((hidden, weights, target))
        if len(samples) < self.online_every:
            return
        net = self.nets[layer]
        # the engine runs under inference mode, whose tensors autograd cannot use: step out of it and copy them
        with torch.inference_mode(False), torch.enable_grad():
            h, w, t = (torch.cat(x).clone() for x in zip(*samples))
            samples.clear()
            net.train()
            loss = llapor_loss(net(h, w), t, net.group, torch.ones(t.shape[1]))
            self.opts[layer].zero_grad()
            loss.backward()
            self.opts[layer].step()
            net.eval()
