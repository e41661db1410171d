"""Which ways of holding a model fit a device's memory, and what each costs a request: CoMoE's Tables I–II.

Four deployments (CoMoE §IV-C): `original` — every weight on the device; `merged` (M-SMoE) — a merged variant, as
many experts in each MoE layer as a real merge kept there (`MergedLayers`: a merged store's groups, whose router is
the original's with each group's probabilities summed), on the device; `offloaded`
(E-Offload) — dense weights on the device, experts in host memory behind an expert cache of what the device has
left; `merged+offloaded` (CoMoE) — both. Offloading covers every MoE layer (`scope="all"`, what moetier does) or,
as the paper does for Switch (§III-B 3, §IV-D), the encoder's alone, the decoder's experts resident
(`scope="encoder"`).

A deployment fits when the device holds its dense weights, its resident experts, the runtime's workspace and, if
it offloads, an expert cache of at least one layer's top-k; and host memory holds the experts it offloads. Sizes
are the shape's at one precision (ModelShape: the embedding tied to the head, norms and biases left out)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from moetier.cache.keys import ExpertKey
from moetier.cache.policies import DEFAULT_POLICY, PolicyContext, make_policy
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


@dataclass(frozen=True)
class MergedLayers:
    """What a real merge (`moetier merge`, moetier/merge/merge.py) made of a model: for each MoE layer, each expert's
    principal (a merged store's `moetier_merged.groups`, Eq. 29; a principal is its own) — how many experts the
    layer keeps, and where its tokens go."""

    groups: Mapping[int, tuple[int, ...]]  # MoE layer -> [E] principal of each expert

    def __post_init__(self) -> None:
        for layer, group_of in self.groups.items():
            if not group_of or any(not 0 <= g < len(group_of) or group_of[g] != g for g in group_of):
                raise ValueError(f"layer {layer}'s groups must map each expert to a principal that maps to itself")

    def principals(self, layer: int) -> tuple[int, ...]:
        return tuple(sorted(set(self.groups[layer])))

    def kept(self, layer: int) -> int:
        return len(set(self.groups[layer]))


def _experts_held(shape: ModelShape, merged: MergedLayers | None) -> dict[int, int]:
    """Experts each MoE layer holds: the merge's count, or the shape's."""
    if merged is not None and set(merged.groups) != set(shape.moe_layers):
        raise ValueError(f"the merge covers layers {sorted(merged.groups)}, the shape's MoE layers are "
                         f"{list(shape.moe_layers)}")
    return {layer: merged.kept(layer) if merged is not None else shape.num_experts for layer in shape.moe_layers}


def fit(shape: ModelShape, deployment: Deployment, device_bytes: int, host_bytes: int, workspace_bytes: int,
        precision: str, merged: MergedLayers | None = None) -> Fit:
    """Whether `deployment` of `shape` fits a device of `device_bytes` beside a host of `host_bytes`; a merged
    deployment holds what the real merge `merged` kept in each layer (the dense weights are the original's: a
    merged store keeps the whole router, its groups summing its probabilities)."""
    if deployment.merged and merged is None:
        raise ValueError("a merged deployment needs the merge (MergedLayers) it holds")
    held_experts = _experts_held(shape, merged if deployment.merged else None)
    expert = shape.expert_bytes(precision)
    offloaded = tuple(layer for layer in shape.moe_layers if deployment.offloaded and
                      (deployment.scope == "all" or layer < shape.encoder_layers))
    resident = sum(n for layer, n in held_experts.items() if layer not in offloaded) * expert
    fixed = shape.dense_bytes(precision) + resident + workspace_bytes
    behind = sum(held_experts[layer] for layer in offloaded)
    least = shape.top_k * expert if offloaded else 0
    slots = min(max(0, device_bytes - fixed) // expert, behind) if offloaded else 0
    why = ""
    if fixed + least > device_bytes:
        why = f"needs {(fixed + least) / 1e9:.1f} GB on the device"
    elif behind * expert > host_bytes:
        why = f"offloads {behind * expert / 1e9:.1f} GB to a host of {host_bytes / 1e9:.0f} GB"
    return Fit(fixed + least, behind * expert, slots, offloaded, not why, why)


def merged_routing(trace: Trace, merged: MergedLayers) -> Trace:
    """A trace's routing as the merged model routes it: each expert's tokens go to its principal (ids kept, as a
    merged store keeps its principals' ids). The merged router sends a token to the group whose summed probability
    is highest; a trace of top-k ids alone has only each token's chosen experts, so a group is taken by its chosen
    member — exact at top-1 when the chosen expert's group also has the highest sum, which the trace cannot tell.
    A top-k whose members fall in one group keeps the group once and fills the rest with the layer's other
    principals, most used first."""
    def remap(table: Trace) -> Trace:
        ids = table.topk_ids.astype(np.int64)  # [N, L, k]
        out = np.empty_like(ids)
        for j, layer in enumerate(table.layers):
            group = np.asarray(merged.groups[layer], np.int64)  # [E]
            mapped = group[ids[:, j]]  # [N, k]
            out[:, j] = mapped
            if table.top_k == 1:
                continue
            counts = np.bincount(mapped.ravel(), minlength=table.num_experts)
            order = [int(p) for p in np.argsort(-counts, kind="stable") if group[p] == p]
            for t in np.flatnonzero([len(set(row)) < table.top_k for row in mapped.tolist()]):
                seen = list(dict.fromkeys(mapped[t].tolist()))
                out[t, j] = seen + [p for p in order if p not in seen][:table.top_k - len(seen)]
        return dataclasses.replace(table, topk_ids=out.astype(np.int16), scores=None, gate_inputs=None,
                                   notes=[*table.notes, "routed as the merged model routes it"], encoder=None)

    encoder = remap(trace.encoder) if trace.encoder is not None else None
    return dataclasses.replace(remap(trace), encoder=encoder)


def with_decoder_resident(trace: Trace) -> Trace:
    """The trace with the decoder's columns left out: a replay runs those layers with every expert resident (the
    paper's encoder-only offloading), the encoder's through the cache."""
    return dataclasses.replace(trace, layers=[], topk_ids=trace.topk_ids[:, :0], topk_weights=trace.topk_weights[:, :0],
                               scores=None, gate_inputs=None, notes=[*trace.notes, "the decoder's experts resident"])


def request_latency(trace: Trace, shape: ModelShape, deployment: Deployment, fitted: Fit, profile: HardwareProfile,
                    precision: str, policy: str = DEFAULT_POLICY, merged: MergedLayers | None = None) -> dict:
    """`trace` (the original's routing; routed as `merged` routes it if the deployment is merged) replayed on
    `profile`'s clock: every expert resident, or the offloaded layers' through a cache of `fitted.cache_slots` under
    `policy`, filled before the first request as Engine.preload() does (with the experts the deployment holds).
    Per request: the whole of it (encoding, the first token, the rest), its first step and its decode steps."""
    if deployment.merged:
        if merged is None:
            raise ValueError("a merged deployment needs the merge (MergedLayers) it holds")
        trace = merged_routing(trace, merged)
    if deployment.offloaded and deployment.scope == "encoder":
        trace = with_decoder_resident(trace)
    layers = tuple(trace.all_layers)
    held = {layer: merged.principals(layer) if deployment.merged else range(shape.num_experts) for layer in layers}
    slots = fitted.cache_slots if deployment.offloaded else sum(len(ids) for ids in held.values())
    ctx = PolicyContext(slots, layers, shape.num_experts, shape.top_k)
    result = simulate(trace, make_policy(policy, ctx), slots, CostModel.of(profile, shape, precision), precision,
                      preload=[ExpertKey(layer, e) for layer in layers for e in held[layer]])
    times, phase = np.asarray(result.step_time_s), np.asarray(result.step_phase)
    requests = int((phase == PREFILL).sum())
    return {"request_s": float(times.sum() / requests), "first_token_s": float(times[phase == PREFILL].mean()),
            "tpot_s": float(times[phase == DECODE].mean()) if (phase == DECODE).any() else None,
            "hit_rate": result.hit_rate,
            "expert_bytes_per_request": float(np.sum(result.bytes_read) / requests)}
