"""How alike two experts of a layer are (CoMoE §III-B 1, Eq. 25–26), from their weights and from what they compute.

S_param (Eq. 25): the cosine of the two experts' parameter vectors (gate, up and down projections flattened end to
end), accumulated tensor by tensor so a layer's experts never sit in memory as one [E, P] matrix.

S_func (Eq. 26) as the paper writes it, 1 − mean KL(e_i(x) ‖ e_j(x)), needs each expert's output to be a
probability distribution; an expert's output is a vector in the hidden space (any sign, any norm), so KL is not
defined on it. Here instead: **S_func = 1 − mean over calibration tokens x of ‖y_i − y_j‖ / (‖y_i‖ + ‖y_j‖)**,
y = e(x) in fp32 — 1 where two experts answer every token alike, 1 − √2/2 ≈ 0.29 where their answers are orthogonal
and of equal size, 0 where they are opposite; symmetric and bounded like S_param, so α in Eq. 27 weighs comparable numbers. The
tokens are the layer's own expert inputs on calibration text (a trace's router inputs: moetier/trace)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F


def parameter_similarity(chunks: Iterable[torch.Tensor]) -> torch.Tensor:
    """Eq. 25: `chunks` [E, p_c] — the E experts' parameters, a slice of each at a time, in any split — ->
    cosine similarities [E, E] (fp64)."""
    gram = None
    for c in chunks:
        c = c.reshape(c.shape[0], -1).double()
        g = c @ c.T
        gram = g if gram is None else gram + g
    if gram is None:
        raise ValueError("no parameters")
    norms = gram.diagonal().clamp_min(1e-300).sqrt()
    return gram / (norms[:, None] * norms[None, :])


def expert_hidden(tensors: dict[str, torch.Tensor], x: torch.Tensor, activation: str = "swiglu") -> torch.Tensor:
    """An expert's hidden units on tokens x [N, H] -> [N, I] in fp32: silu(gate x) * up x for SwiGLU experts
    (gate_up_proj [2I, H]), relu(up x) for ReLU ones (Switch's up_proj [I, H])."""
    x = x.float()
    if activation == "relu":
        return F.relu(x @ tensors["up_proj"].float().T)
    g, u = (x @ tensors["gate_up_proj"].float().T).chunk(2, dim=-1)  # [N, I] each
    return F.silu(g) * u


def expert_output(tensors: dict[str, torch.Tensor], x: torch.Tensor, activation: str = "swiglu") -> torch.Tensor:
    """One expert on tokens x [N, H] in fp32: down(hidden(x)) [N, H]."""
    return expert_hidden(tensors, x, activation) @ tensors["down_proj"].float().T


def functional_similarity(outputs: torch.Tensor) -> torch.Tensor:
    """S_func (this module's definition, see above): outputs [E, N, H] — each expert on the same N tokens — ->
    [E, E] (fp64): 1 − mean_x ‖y_i − y_j‖ / (‖y_i‖ + ‖y_j‖)."""
    y = outputs.double()
    num = y.shape[0]
    norms = y.norm(dim=-1)  # [E, N]
    out = torch.ones(num, num, dtype=torch.float64)
    for i in range(num):
        dist = (y[i][None] - y).norm(dim=-1)  # [E, N]
        denom = (norms[i][None] + norms).clamp_min(1e-300)
        out[i] = 1 - (dist / denom).mean(dim=-1)
    return out
