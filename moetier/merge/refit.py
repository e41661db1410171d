"""Refitting a merged expert to what its group computed on calibration tokens (`--refit down|all`): an addition to
CoMoE's Eq. 30, which averages weights and stops there.

A merged expert stands for its group: a token the original routed to members j of the group (with router weights
w_j) is sent to it once, so what it should answer is the members' mix, y(x) = Σ w_j e_j(x) / Σ w_j. Averaging the
weights gives that only where the members are alike. Keeping the averaged gate and up projections (so the hidden
units h(x) are fixed), the down projection that comes closest on the calibration tokens is a linear least-squares
problem; ridge-regularised towards the averaged down projection (so a group with few tokens stays near Eq. 30):

    W = argmin Σ_x ‖W h(x) − y(x)‖² + λ ‖W − W_avg‖²  =  (Yᵀ H + λ W_avg) (Hᵀ H + λ I)⁻¹,   λ = ridge · mean diag(Hᵀ H)

`all` then tunes every weight of the merged expert (gate, up and down) towards y(x) by TUNE_STEPS of Adam on the mean
squared error, kept at the step that did best on a held-out fifth of the group's tokens — a distillation of the
group into one expert, local to it (nothing else of the model moves). It costs TUNE_STEPS forward and backward passes
of each merged expert over its tokens: seconds for the demo models, hours for an OLMoE's experts on a CPU.

The tokens are the layer's expert inputs recorded with the calibration trace (its router inputs), never the
held-out text quality is measured on."""

from __future__ import annotations

import numpy as np
import torch

from moetier.merge.similarity import expert_hidden, expert_output

REFITS = ("none", "down", "all")  # Eq. 30 alone; its down projection refitted; then every weight tuned
RIDGE = 0.05  # λ relative to the mean energy of a hidden unit on the group's tokens
MAX_TOKENS = 8192  # calibration tokens per group (evenly spaced beyond that)
TUNE_STEPS, TUNE_LR = 100, 1e-3  # `all`: measured on demo-deep's fixed-medium, 300 steps overfit (docs/merging.md)


def refit_expert(kind: str, merged: dict[str, torch.Tensor], members: dict[int, dict[str, torch.Tensor]],
                 x: torch.Tensor, shares: np.ndarray, activation: str) -> dict[str, torch.Tensor]:
    """`merged` refitted as `kind` (one of REFITS) to its group `members` on tokens x [N, H] with shares [N, M]."""
    if kind == "none":
        return merged
    merged = refit_down(merged, members, x, shares, activation)
    return tune(merged, members, x, shares, activation, TUNE_STEPS, TUNE_LR) if kind == "all" else merged


def group_tokens(topk_ids: np.ndarray, topk_weights: np.ndarray, members: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The calibration rows routed to any of `members` ([T, k] ids and weights of one layer) and each member's
    share of the row's routing to the group [T', len(members)] (rows sum to 1)."""
    weights = np.zeros((len(topk_ids), len(members)), np.float64)
    for j, e in enumerate(members):
        weights[:, j] = np.where(topk_ids == e, topk_weights.astype(np.float64), 0.0).sum(axis=1)
    rows = np.flatnonzero(weights.sum(axis=1) > 0)
    if len(rows) > MAX_TOKENS:
        rows = rows[np.linspace(0, len(rows) - 1, MAX_TOKENS).round().astype(int)]
    shares = weights[rows]
    return rows, shares / shares.sum(axis=1, keepdims=True)


def refit_down(merged: dict[str, torch.Tensor], members: dict[int, dict[str, torch.Tensor]], x: torch.Tensor,
               shares: np.ndarray, activation: str, ridge: float = RIDGE) -> dict[str, torch.Tensor]:
    """`merged` with its down projection refitted (module docstring): x [N, H] the group's calibration tokens,
    shares [N, M] each of the M `members` (in sorted id order) share of each token."""
    if len(x) == 0:
        return merged
    ids = sorted(members)
    s = torch.from_numpy(shares).float()  # [N, M]
    target = sum(s[:, j:j + 1] * expert_output(members[e], x, activation) for j, e in enumerate(ids))  # [N, H]
    h = expert_hidden(merged, x, activation).double()  # [N, I]
    gram = h.T @ h  # [I, I]
    lam = ridge * float(gram.diagonal().mean().clamp_min(1e-12))
    w_avg = merged["down_proj"].double()  # [H, I]
    rhs = target.double().T @ h + lam * w_avg  # [H, I]
    down = torch.linalg.solve(gram + lam * torch.eye(len(gram), dtype=torch.float64), rhs.T).T  # (gram symmetric)
    return dict(merged, down_proj=down.to(merged["down_proj"].dtype))


def tune(merged: dict[str, torch.Tensor], members: dict[int, dict[str, torch.Tensor]], x: torch.Tensor,
         shares: np.ndarray, activation: str, steps: int, lr: float = 1e-3, held_out: float = 0.2) -> dict[str, torch.Tensor]:
    """`merged` with every weight tuned to its group's mix by `steps` of Adam on the mean squared error over the
    calibration tokens, kept at the step that did best on a held-out share of them (the start counts: it never comes
    out worse there)."""
    if len(x) < 10 or steps <= 0:
        return merged
    ids = sorted(members)
    s = torch.from_numpy(shares).float()
    with torch.no_grad():
        target = sum(s[:, j:j + 1] * expert_output(members[e], x, activation) for j, e in enumerate(ids))  # [N, H]
    cut = int(len(x) * (1 - held_out))
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    fit, check = order[:cut], order[cut:]
    params = {k: v.detach().float().clone().requires_grad_(True) for k, v in merged.items()}
    opt = torch.optim.Adam(params.values(), lr=lr)
    scale = float(target[fit].square().mean().clamp_min(1e-12))  # (a loss near 1 whatever the layer's norm)

    def loss(rows: torch.Tensor) -> torch.Tensor:
        return (expert_output(params, x[rows], activation) - target[rows]).square().mean() / scale

    with torch.no_grad():
        best, best_loss = {k: v.clone() for k, v in params.items()}, float(loss(check))
    for _ in range(steps):
        opt.zero_grad()
        loss(fit).backward()
        opt.step()
        with torch.no_grad():
            now = float(loss(check))
            if now < best_loss:
                best, best_loss = {k: v.clone() for k, v in params.items()}, now
    return {k: best[k].to(v.dtype) for k, v in merged.items()}
