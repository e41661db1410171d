"""Routing as each family's reference does it: x [T, H] -> scores [T, E] fp32 (what policies read), topk_ids [T, k]
int64, topk_weights [T, k] (fp32 or the model's dtype, as the reference weighs expert outputs).

One class per published router, chosen once per model by `make_router`; each reads the layer's `router` weight
(and `router.bias`, `router.e_score_correction_bias` where the family has them)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moetier.config import RouterSpec

Routed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class SoftmaxRouter:
    """Softmax over all experts in fp32, top-k, renormalised if the family does, times routed_scaling_factor
    (Mixtral, Qwen, OLMoE; DeepSeek-V2's greedy with fp32 logits)."""

    def __init__(self, spec: RouterSpec, top_k: int, linear: Linear = F.linear) -> None:
        """`linear`: the engine's product in the model's dtype — its native kernel, where torch's bf16 F.linear of
        one row by OLMoE's 64 x 2048 router took ~140 us a layer on a Zen 4 (7% of a resident int4 decode step in
        a sampling profile) for 256 KB of weights."""
        self.spec, self.top_k, self.linear = spec, top_k, linear

    def logits(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.spec.fp32:  # DeepSeek, GLM, Switch: fp32 copies of input and weight
            return F.linear(x.float(), w["router"].float(), _float(w.get("router.bias")))
        return self.linear(x, w["router"], w.get("router.bias"))

    def choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights, topk_ids) from the fp32 scores [T, E]."""
        return torch.topk(scores, self.top_k, dim=-1)

    def __call__(self, x: torch.Tensor, w: dict[str, torch.Tensor], segments=None) -> Routed:
        return self.route(self.logits(x, w), x.dtype)

    def route(self, logits: torch.Tensor, dtype: torch.dtype) -> Routed:
        """From the logits [T, E] (made here, or by a decode block: moetier/model/decode_block.py)."""
        scores = F.softmax(logits, dim=-1, dtype=torch.float32)
        topk_weights, topk_ids = self.choose(scores)  # [T, k]
        return scores, topk_ids, self.finish(topk_weights, dtype)

    def finish(self, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.spec.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        if self.spec.scaling_factor != 1.0:
            topk_weights = topk_weights * self.spec.scaling_factor
        return topk_weights if self.spec.fp32_weights else topk_weights.to(dtype)


class NativeSoftmaxRouter(SoftmaxRouter):
    """SoftmaxRouter's `route` in one native call (`csrc/route.c`: softmax, top-k, renormalising, scaling, rounding)
    on the native kernels, whose every path routes through it. Why: at batch 1 the four or five torch ops took
    ~130 us a layer with the caches cold from the experts just streamed (OLMoE-1B-7B on a Zen 4: ~2 ms of a ~50 ms
    bf16 step). The experts are torch.topk's in its order, ties broken as it breaks them (route.c makes its
    selection's moves); the scores are torch's to within a few ulps (its vectorised exp and order of sums)."""

    def __init__(self, spec: RouterSpec, top_k: int, linear: Linear, lib) -> None:
        super().__init__(spec, top_k, linear)
        self.lib = lib

    def route(self, logits: torch.Tensor, dtype: torch.dtype) -> Routed:
        weights_dtype = torch.float32 if self.spec.fp32_weights else dtype
        if (logits.dtype not in (torch.float32, torch.bfloat16) or weights_dtype not in (torch.float32, torch.bfloat16)
                or not logits.is_contiguous() or logits.device.type != "cpu"):
            return super().route(logits, dtype)
        t, e = logits.shape
        scores = torch.empty(t, e, dtype=torch.float32)
        topk_ids = torch.empty(t, self.top_k, dtype=torch.int64)
        topk_weights = torch.empty(t, self.top_k, dtype=weights_dtype)
        self.lib.moetier_route_softmax(logits.data_ptr(), 32 if logits.dtype == torch.float32 else 16, t, e,
                                       self.top_k, int(self.spec.norm_topk_prob), self.spec.scaling_factor,
                                       int(weights_dtype == torch.bfloat16), scores.data_ptr(), topk_ids.data_ptr(),
                                       topk_weights.data_ptr())
        return scores, topk_ids, topk_weights


class GroupLimitedRouter(SoftmaxRouter):
    """DeepSeek-V2's group_limited_greedy: experts in n_group groups, a group ranked by its best score; top-k among
    the topk_group best groups (the others' scores set to 0)."""

    def choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = _group_mask(scores.view(scores.shape[0], self.spec.num_groups, -1).amax(dim=-1), self.spec.topk_groups,
                           scores.shape[-1])
        return torch.topk(scores.masked_fill(~mask, 0.0), self.top_k, dim=-1)


class NoAuxRouter(SoftmaxRouter):
    """DeepSeek-V3 / Moonlight / GLM-4.5 (noaux_tc): sigmoid scores; experts chosen by score plus the
    e_score_correction_bias, within the topk_group groups whose two best biased scores sum highest; weighted by
    their unbiased scores, renormalised (+1e-20) if norm_topk_prob, times routed_scaling_factor."""

    def __call__(self, x: torch.Tensor, w: dict[str, torch.Tensor], segments=None) -> Routed:
        scores = self.logits(x, w).sigmoid()  # [T, E] fp32
        choice = scores + w["router.e_score_correction_bias"]
        groups = choice.view(choice.shape[0], self.spec.num_groups, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        mask = _group_mask(groups, self.spec.topk_groups, choice.shape[-1])
        topk_ids = torch.topk(choice.masked_fill(~mask, float("-inf")), self.top_k, dim=-1)[1]
        topk_weights = scores.gather(1, topk_ids)
        if self.spec.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, topk_ids, topk_weights * self.spec.scaling_factor


class SparseMixerRouter(SoftmaxRouter):
    """Phi-MoE's sparsemixer at evaluation: the best expert, weighted by a softmax over the experts whose logits lie
    within 2·jitter_eps (relative) of it; then the same for the best of the rest. Always two experts."""

    def __call__(self, x: torch.Tensor, w: dict[str, torch.Tensor], segments=None) -> Routed:
        logits = self.logits(x, w)  # [T, E] in the model's dtype, as the reference's
        first, w1 = self._pick(logits, logits)
        rest = torch.scatter(logits, -1, first, float("-inf"))
        second, w2 = self._pick(logits, rest)
        scores = F.softmax(logits, dim=-1, dtype=torch.float32)
        return scores, torch.cat((first, second), dim=-1), torch.cat((w1, w2), dim=-1)

    def _pick(self, logits: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        best, ids = candidates.max(dim=-1, keepdim=True)  # [T, 1]
        factor = logits.abs().clamp(min=best)
        far = ((best - logits) / factor) > 2 * self.spec.jitter_eps
        gates = torch.softmax(candidates.masked_fill(far, float("-inf")), dim=-1)
        return ids, gates.gather(-1, ids)


class TopkSoftmaxRouter(SoftmaxRouter):
    """gpt-oss: top-k of the (biased) logits, softmax over those k alone, in the logits' dtype."""

    def __call__(self, x: torch.Tensor, w: dict[str, torch.Tensor], segments=None) -> Routed:
        logits = self.logits(x, w)  # [T, E]
        top, topk_ids = torch.topk(logits, self.top_k, dim=-1)
        topk_weights = F.softmax(top, dim=1, dtype=top.dtype)
        return F.softmax(logits, dim=-1, dtype=torch.float32), topk_ids, topk_weights


class Top1Router(SoftmaxRouter):
    """Switch: the argmax expert, weighted by its probability (in the model's dtype). An expert takes at most
    `capacity` tokens of one sequence in one forward, in order; the reference computes nothing for the tokens
    beyond, and neither do we in effect: they keep the expert with weight 0 (its output times 0 adds exactly 0)."""

    def __call__(self, x: torch.Tensor, w: dict[str, torch.Tensor], segments=None) -> Routed:
        scores = F.softmax(self.logits(x, w), dim=-1, dtype=torch.float32)  # [T, E]
        return self.top1(scores, scores, x.dtype, segments)

    def top1(self, scores: torch.Tensor, ranked: torch.Tensor, dtype: torch.dtype, segments) -> Routed:
        """The best of `ranked` [T, E] per token, weighted by its value, under the capacity; `scores` are what the
        policies read."""
        topk_weights, topk_ids = ranked.to(dtype).max(dim=-1, keepdim=True)  # [T, 1]
        for first, length in segments or ():
            if length > self.spec.capacity:  # only a long prompt can fill an expert
                ids = topk_ids[first:first + length, 0]
                one_hot = F.one_hot(ids, scores.shape[-1])
                rank = one_hot.cumsum(dim=0).gather(1, ids[:, None])  # [t, 1] the token's place in its expert's queue
                topk_weights[first:first + length].masked_fill_(rank > self.spec.capacity, 0.0)
        return scores, topk_ids, topk_weights


class MergedTop1Router(Top1Router):
    """A merged Switch model's (CoMoE's own models, §IV): Switch's softmax over the original experts, each group's
    probabilities summed into its principal (as MergedRouter), then Switch's top-1 over the principals weighted by
    the group's sum, under the same capacity (counted per merged expert: a merged expert is one expert). Reads the
    layer's `router.groups` and `router.absent` as MergedRouter does."""

    def __call__(self, x: torch.Tensor, w: dict[str, torch.Tensor], segments=None) -> Routed:
        probs = F.softmax(self.logits(x, w), dim=-1, dtype=torch.float32)  # [T, E]
        scores = torch.zeros_like(probs).index_add_(1, w["router.groups"], probs)  # [T, E]: a group's sum
        return self.top1(scores, scores.masked_fill(w["router.absent"], -1.0), x.dtype, segments)


class MergedRouter(SoftmaxRouter):
    """A merged model's (moetier/merge: CoMoE §III-B, Eq. 30): the family's softmax over the original experts, each
    group's probabilities summed into its principal — the merged expert, which keeps the principal's id — then
    top-k over the principals and the family's renormalising and scaling of those sums. So a token that the
    original router sent to any member of a group goes to the merged expert with the weight the whole group had,
    and with norm_topk_prob the k groups' weights sum to 1 as the k experts' did. The scores the policies read are
    the groups' sums (0 for a merged-away id). Reads the layer's `router.groups` [E] int64 (each expert's principal)
    and `router.absent` [E] bool, which the model adds from its spec."""

    def __call__(self, x: torch.Tensor, w: dict[str, torch.Tensor], segments=None) -> Routed:
        probs = F.softmax(self.logits(x, w), dim=-1, dtype=torch.float32)  # [T, E]
        scores = torch.zeros_like(probs).index_add_(1, w["router.groups"], probs)  # [T, E]: a group's sum
        # (a group's sum may underflow to 0: a merged-away id must still never be chosen)
        topk_weights, topk_ids = self.choose(scores.masked_fill(w["router.absent"], -1.0))  # [T, k]
        return scores, topk_ids, self.finish(topk_weights, x.dtype)


def _group_mask(group_scores: torch.Tensor, topk_groups: int, num_experts: int) -> torch.Tensor:
    """[T, E] True for the experts of each token's topk_groups best groups."""
    t, g = group_scores.shape
    chosen = torch.topk(group_scores, topk_groups, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)  # [T, G]
    return mask[:, :, None].expand(t, g, num_experts // g).reshape(t, num_experts)


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


ROUTER_CLASSES = {"softmax": SoftmaxRouter, "group-limited": GroupLimitedRouter, "noaux-tc": NoAuxRouter,
                  "sparsemixer": SparseMixerRouter, "topk-softmax": TopkSoftmaxRouter, "top1": Top1Router}


def make_router(spec: RouterSpec, top_k: int, linear: Linear = F.linear, lib=None,
                merged: bool = False) -> SoftmaxRouter:
    """`lib`: the native library, where the native kernels run (a plain softmax router then routes through it).
    `merged`: the model's experts were merged (ModelSpec.expert_groups; a softmax or top-1 router's)."""
    if merged:
        return (MergedTop1Router if spec.kind == "top1" else MergedRouter)(spec, top_k, linear)
    if lib is not None and spec.kind == "softmax":
        return NativeSoftmaxRouter(spec, top_k, linear, lib)
    return ROUTER_CLASSES[spec.kind](spec, top_k, linear)


def add_groups(layers: list[dict[str, torch.Tensor]], spec, device: torch.device) -> None:
    """A merged model's layers get `router.groups` [E] (each expert's principal) and `router.absent` [E] (merged
    away), which the merged routers read (ModelSpec.expert_groups; nothing for a model not merged)."""
    for layer, groups in zip(spec.moe_layers, spec.expert_groups):
        g = torch.tensor(groups, dtype=torch.int64, device=device)  # [E]
        layers[layer].update({"router.groups": g, "router.absent": g != torch.arange(len(groups), device=device)})
