"""`comoe-mlp`: CoMoE's activation predictor (Eq. 36) — a two-layer perceptron per MoE layer,

    p(e^{l+1} | x_t) = Softmax(W2 · ReLU(W1 · [e_1^l, ..., e_K^l, h_t, c_t] + b1) + b2),

on the experts the current layer chose (as a multi-hot vector over the experts), the current hidden state h_t (the
router's input) and a context c_t. The paper does not define c_t or the width: here c_t is the mean of the
sequence's earlier hidden states at this layer (reset with each sequence), the width 256. Trained with the cross
entropy against the next layer's choices as a distribution (1/k on each). It predicts one layer ahead; scores
are the softmax probabilities, which its prefetch threshold (Eq. 19) and its eviction score (Eq. 38) read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from moetier.predict.base import Predictions, Predictor


class ComoeNet(nn.Module):
    def __init__(self, hidden: int, num_experts: int, width: int = 256) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(num_experts + 2 * hidden, width), nn.ReLU(), nn.Linear(width, num_experts))

    def forward(self, chosen: torch.Tensor, hidden: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """[T, E] multi-hot, [T, H], [T, H] -> [T, E] logits."""
        return self.net(torch.cat([chosen, hidden, context], dim=-1))


def multi_hot(topk_ids: np.ndarray, num_experts: int) -> torch.Tensor:
    out = np.zeros((topk_ids.shape[0], num_experts), np.float32)
    np.put_along_axis(out, topk_ids.astype(np.int64), 1.0, axis=1)
    return torch.from_numpy(out)


def running_context(hidden: torch.Tensor, seq: np.ndarray) -> torch.Tensor:
    """[N, H] hidden states in order, with their sequence ids -> [N, H] the mean of each row's earlier rows of the
    same sequence (zeros for a sequence's first)."""
    out = torch.zeros_like(hidden)
    total, count, current = torch.zeros(hidden.shape[1]), 0, None
    for i in range(len(hidden)):
        if seq[i] != current:
            total, count, current = torch.zeros(hidden.shape[1]), 0, seq[i]
        if count:
            out[i] = total / count
        total, count = total + hidden[i], count + 1
    return out


def train_layer(chosen: torch.Tensor, hidden: torch.Tensor, context: torch.Tensor, target: torch.Tensor,
                epochs: int = 30, lr: float = 1e-3, batch: int = 256, seed: int = 0) -> ComoeNet:
    """`target` [N, E]: the next layer's choices as a distribution per row."""
    torch.manual_seed(seed)
    net = ComoeNet(hidden.shape[1], target.shape[1])
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(hidden), generator=g).split(batch):
            logits = net(chosen[idx], hidden[idx], context[idx])
            loss = -(target[idx] * torch.log_softmax(logits, -1)).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net.eval()


class ComoeMLPPredictor(Predictor):
    name = "comoe-mlp"

    def __init__(self, moe_layers: Sequence[int], num_experts: int, top_k: int, nets: Mapping[int, ComoeNet],
                 distance: int = 1) -> None:
        """nets: for each MoE layer but the last, the network predicting the next one."""
        super().__init__(moe_layers, num_experts, top_k, distance)
        missing = [layer for layer in self.moe_layers[:-1] if layer not in nets]
        if missing:
            raise ValueError(f"no comoe-mlp network for layers {missing}")
        self.nets = dict(nets)
        self._chosen: dict[int, torch.Tensor] = {}
        self._context: dict[int, tuple[torch.Tensor, int]] = {}  # layer -> (sum of hidden states, count)

    def on_sequence_start(self) -> None:
        self._context.clear()

    def observe(self, layer: int, gate_input, route) -> None:
        self._chosen[layer] = multi_hot(route.topk_ids, self.num_experts)

    def predict(self, layer: int, gate_input) -> Predictions:
        net = self.nets.get(layer)
        if net is None or gate_input is None:
            return {}
        hidden = torch.as_tensor(gate_input).float().cpu()  # [T, H]
        total, count = self._context.get(layer, (torch.zeros(hidden.shape[1]), 0))
        # batch 1 decoding keeps one context; a batch shares the running mean of all its rows (a simplification)
        context = (total / count if count else total).expand_as(hidden)
        self._context[layer] = (total + hidden.sum(0), count + hidden.shape[0])
        nxt = self.moe_layers[self._index[layer] + 1]
        with torch.no_grad():
            return {nxt: torch.softmax(net(self._chosen[layer], hidden, context), -1).numpy()}
