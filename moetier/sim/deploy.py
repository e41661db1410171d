"""Which ways of holding a model fit a device's memory, and what each costs a request: CoMoE's Tables I–II.

Four deployments (CoMoE §IV-C): `original` — every weight on the device; `merged` (M-SMoE) — a merged variant,
⌊r·E⌋ experts a MoE layer (Eq. 28's fixed ratio; each layer's router shrinks with it), on the device; `offloaded`
(E-Offload) — dense weights on the device, experts in host memory behind an expert cache of what the device has
left; `merged+offloaded` (CoMoE) — both. Offloading covers every MoE layer (`scope="all"`, what moetier does) or,
as the paper does for Switch (§III-B 3, §IV-D), the encoder's alone, the decoder's experts resident
(`scope="encoder"`).

A deployment fits when the device holds its dense weights, its resident experts, the runtime's workspace and, if
it offloads, an expert cache of at least one layer's top-k; and host memory holds the experts it offloads. Sizes
are the shape's at one precision (ModelShape: the embedding tied to the head, norms and biases left out)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from moetier.cache.policies import PolicyContext, make_policy
from moetier.plan.route import DECODE, PREFILL
from moetier.sim.cost import CostModel
from moetier.sim.profile import HardwareProfile
from moetier.sim.replay import simulate
from moetier.sim.shapes import ModelShape
from moetier.trace.format import Trace

SCOPES = ("all", "encoder")


@dataclass(frozen=True)
class Deployment:
    merged: bool
    offloaded: bool
    scope: str = "all"  # offloading's: every MoE layer's experts, or the encoder's alone

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"offload scope {self.scope!r}: one of {', '.join(SCOPES)}")

    @property
    def name(self) -> str:
        base = {(False, False): "original", (True, False): "merged", (False, True): "offloaded",
                (True, True): "merged+offloaded"}[self.merged, self.offloaded]
        return f"{base} ({self.scope})" if self.offloaded and self.scope != "all" else base


DEPLOYMENTS = (Deployment(False, False), Deployment(True, False), Deployment(False, True), Deployment(True, True),
               Deployment(False, True, "encoder"), Deployment(True, True, "encoder"))


@dataclass(frozen=True)
class Fit:
    device_bytes: int  # what the device must hold at least: dense, resident experts, workspace, the least cache
    host_bytes: int  # experts offloaded to host memory
    cache_slots: int  # expert slots the device has room for beside the rest (0 if nothing is offloaded)
    offloaded_layers: tuple[int, ...]  # MoE layers whose experts live in host memory
    fits: bool
    why: str  # the limit it breaks, if it does not fit


def merged_shape(shape: ModelShape, ratio: float) -> ModelShape:
    """The shape of a fixed-ratio merged variant: ⌊r·E⌋ experts a MoE layer (at least top-k), Eq. 28."""
    if not 0 < ratio <= 1:
        raise ValueError(f"merge ratio must be in (0, 1], got {ratio}")
    kept = max(shape.top_k, int(ratio * shape.num_experts))
    return dataclasses.replace(shape, name=f"{shape.name} merged r={ratio:g}", num_experts=kept)


def fit(shape: ModelShape, deployment: Deployment, device_bytes: int, host_bytes: int, workspace_bytes: int,
        precision: str) -> Fit:
    """Whether `deployment` of `shape` (already merged if it is) fits a device of `device_bytes` beside a host of
    `host_bytes`."""
    expert = shape.expert_bytes(precision)
    offloaded = tuple(layer for layer in shape.moe_layers if deployment.offloaded and
                      (deployment.scope == "all" or layer < shape.encoder_layers))
    resident = (len(shape.moe_layers) - len(offloaded)) * shape.num_experts * expert
    fixed = shape.dense_bytes(precision) + resident + workspace_bytes
    held = len(offloaded) * shape.num_experts * expert
    least = shape.top_k * expert if offloaded else 0
    slots = min(max(0, device_bytes - fixed) // expert, len(offloaded) * shape.num_experts) if offloaded else 0
    why = ""
    if fixed + least > device_bytes:
        why = f"needs {(fixed + least) / 1e9:.1f} GB on the device"
    elif held > host_bytes:
        why = f"offloads {held / 1e9:.1f} GB to a host of {host_bytes / 1e9:.0f} GB"
    return Fit(fixed + least, held, slots, offloaded, not why, why)


def merge_trace(trace: Trace, kept: int) -> Trace:
    """A trace's routing as a fixed-ratio merged variant routes it: in each layer the `kept` most used experts are
    the principals (Eq. 28), every other expert joins one of them (Eq. 29 by similarity in a real merge; here, at
    shape level where no weights exist, the principals taken in turn), ids renumbered 0..kept-1. A top-k whose
    members fall in one group keeps the group once and fills the rest with the next most used principals."""
    def remap(table: Trace) -> Trace:
        ids = table.topk_ids.astype(np.int64)  # [N, L, k]
        out = np.empty_like(ids)
        for j in range(ids.shape[1]):
            counts = np.bincount(ids[:, j].ravel(), minlength=trace.num_experts)
            order = np.argsort(-counts, kind="stable")
            group = np.empty(trace.num_experts, np.int64)
            group[order[:kept]] = np.arange(kept)
            group[order[kept:]] = np.arange(trace.num_experts - kept) % kept
            for t, row in enumerate(group[ids[:, j]]):
                seen = list(dict.fromkeys(row.tolist()))
                seen += [g for g in range(kept) if g not in seen][:table.top_k - len(seen)]
                out[t, j] = seen
        return dataclasses.replace(table, num_experts=kept, topk_ids=out.astype(np.int16), scores=None,
                                   notes=[*table.notes, f"merged to {kept} experts a layer"], encoder=None)

    encoder = remap(trace.encoder) if trace.encoder is not None else None
    return dataclasses.replace(remap(trace), encoder=encoder)


def with_decoder_resident(trace: Trace) -> Trace:
    """The trace with the decoder's columns left out: a replay runs those layers with every expert resident (the
    paper's encoder-only offloading), the encoder's through the cache."""
    return dataclasses.replace(trace, layers=[], topk_ids=trace.topk_ids[:, :0], topk_weights=trace.topk_weights[:, :0],
                               scores=None, gate_inputs=None, notes=[*trace.notes, "the decoder's experts resident"])


def request_latency(trace: Trace, shape: ModelShape, deployment: Deployment, fitted: Fit, profile: HardwareProfile,
                    precision: str, policy: str = "lru") -> dict:
    """`trace` (the original's routing; merged here if the deployment is) replayed on `profile`'s clock: every
    expert resident, or the offloaded layers' through a cache of `fitted.cache_slots` under `policy`, filled
    before the first request as Engine.preload() does. Per request: the whole of it (encoding, the first token,
    the rest), its first step and its decode steps."""
    if deployment.merged:
        trace = merge_trace(trace, shape.num_experts)
    if deployment.offloaded and deployment.scope == "encoder":
        trace = with_decoder_resident(trace)
    layers = tuple(trace.all_layers)
    slots = fitted.cache_slots if deployment.offloaded else len(layers) * shape.num_experts
    ctx = PolicyContext(slots, layers, shape.num_experts, shape.top_k)
    result = simulate(trace, make_policy(policy, ctx), slots, CostModel.of(profile, shape, precision), precision,
                      preload=True)
    times, phase = np.asarray(result.step_time_s), np.asarray(result.step_phase)
    requests = int((phase == PREFILL).sum())
    return {"request_s": float(times.sum() / requests), "first_token_s": float(times[phase == PREFILL].mean()),
            "tpot_s": float(times[phase == DECODE].mean()) if (phase == DECODE).any() else None,
            "hit_rate": result.hit_rate,
            "expert_bytes_per_request": float(np.sum(result.bytes_read) / requests)}
