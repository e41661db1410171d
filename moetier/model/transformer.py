"""The lean decoder-only MoE transformer: dense weights resident, routed experts delegated to an executor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from moetier.config import ModelSpec
from moetier.model.attention import Attention, SinkAttention
from moetier.model.batch import StepBatch
from moetier.model.decode_block import DecodeBlocks
from moetier.model.kernels import TorchKernels
from moetier.model.kv_cache import KVCache
from moetier.model.layers import layer_weights
from moetier.model.mla import LatentAttention
from moetier.model.resident_step import ResidentStep
from moetier.model.rope import Rope, RopeTables
from moetier.model.router import add_groups, make_router


class Experts(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, scores: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, shared=None) -> torch.Tensor: ...

    # Optional, for a decode step in one native call (moetier/model/resident_step.py):
    # resident_tables() -> one TokenTable a MoE layer, or None (this step's layers are not all resident and
    # unplanned); heard(layer, scores, topk_ids, topk_weights): a layer that step routed, told afterwards.
    # For a decode step replayed as a CUDA graph (moetier/model/decode_graphs.py): resident_on_device(tokens) -> the
    # resident layers (`compute(layer, x, scores, topk_ids, topk_weights, shared)`, no host read), or None.


def attention_class(spec: ModelSpec) -> type:
    if spec.latent_attention is not None:
        return LatentAttention
    return SinkAttention if spec.attention_sinks else Attention


def make_norm(kind: str, eps: float, kernels: TorchKernels) -> Callable[[torch.Tensor, dict, str], torch.Tensor]:
    """The family's norm over the last dimension, chosen once: `norm(x, w, name)` with the weight `w[name]` (and
    the bias `w[name + ".bias"]` of a LayerNorm)."""
    if kind == "rms":
        return lambda x, w, name: kernels.rms_norm(x, w[name], eps)
    if kind == "rms-fp32-weight":
        return lambda x, w, name: kernels.rms_norm_fp32_weight(x, w[name], eps)
    return lambda x, w, name: F.layer_norm(x, x.shape[-1:], w[name], w[name + ".bias"], eps)


def make_add_norm(kind: str, eps: float, kernels: TorchKernels) -> Callable:
    """The residual stream with a sublayer's output added, and the family's norm of it, chosen once:
    `add_norm(h, delta, w, name)` -> (h + delta, norm(h + delta)), or (h, norm(h)) where delta is None (the first
    layer's). An RMSNorm's is the kernels' `add_rms_norm` (gpt-oss's `add_rms_norm_fp32_weight`): one launch on a
    GPU (TritonKernels), two ops elsewhere."""
    norm = make_norm(kind, eps, kernels)
    if kind in ("rms", "rms-fp32-weight"):
        add_rms = kernels.add_rms_norm if kind == "rms" else kernels.add_rms_norm_fp32_weight

        def add(h: torch.Tensor, delta: torch.Tensor, w: dict, name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return add_rms(h, delta, w[name], eps)
    else:
        def add(h: torch.Tensor, delta: torch.Tensor, w: dict, name: str) -> tuple[torch.Tensor, torch.Tensor]:
            h = h + delta
            return h, norm(h, w, name)

    def add_norm(h: torch.Tensor, delta: torch.Tensor | None, w: dict, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return (h, norm(h, w, name)) if delta is None else add(h, delta, w, name)

    return add_norm


class Transformer:
    def __init__(self, spec: ModelSpec, dense: dict[str, torch.Tensor], experts: Experts,
                 kernels: TorchKernels | None = None) -> None:
        self.spec, self.w, self.experts = spec, dense, experts
        self.kernels = kernels or TorchKernels()
        self.dtype, self.device = dense["embed_tokens"].dtype, dense["embed_tokens"].device
        self.lm_head = dense.get("lm_head", dense["embed_tokens"])
        self.lm_head_bias = dense.get("lm_head.bias")
        attention = attention_class(spec)
        self.attn = [attention(spec, i, dense, self.kernels) for i in range(spec.num_layers)]
        self.norm = make_norm(spec.norm, spec.rms_norm_eps, self.kernels)
        self.add_norm = make_add_norm(spec.norm, spec.rms_norm_eps, self.kernels)
        self.router = make_router(spec.router, spec.top_k, self.kernels.linear, getattr(self.kernels, "lib", None),
                                  merged=bool(spec.expert_groups))
        self.is_moe = spec.is_moe_layer
        self.layers = layer_weights(dense, spec.num_layers)
        add_groups(self.layers, spec, self.device)  # a merged model's (MergedRouter reads them)
        # one native call a layer for a one-sequence decode step's attention (None where it does not apply)
        self.blocks = DecodeBlocks.make(spec, dense["embed_tokens"], self.attn, self.layers, self.router, self.is_moe,
                                        self.kernels)
        # the whole step in one native call where every expert is resident (None where it does not apply)
        self.resident_step = ResidentStep.make(spec, self.blocks, self.router, self.is_moe)
        self.graphs = None  # a decode step replayed as a CUDA graph where it applies (DecodeGraphs; set by the engine)
        self.rope: Rope | None = None
        # the forward step in progress and its residual stream at the MoE layer running now, for `lookahead`
        self._step: tuple[StepBatch, KVCache, RopeTables] | None = None
        self._h: torch.Tensor | None = None

    def ensure_rope(self, max_len: int) -> Rope:
        if self.rope is None or self.rope.max_len < max_len:
            mla = self.spec.latent_attention
            self.rope = Rope(self.spec.rope, mla.qk_rope_head_dim if mla else self.spec.head_dim, max_len, self.dtype,
                             self.device)
        return self.rope

    def _moe(self, layer: int, x: torch.Tensor, segments: list[tuple[int, int]] | None,
             logits: torch.Tensor | None = None, experts: Experts | None = None) -> torch.Tensor:
        """`segments`: each prompt's (first token, length) in a prefill (a router with an expert capacity counts per
        prompt); None in a decode step. `logits`: the router's, where a decode block made them. `experts`: who
        computes them (None: the engine's, `self.experts`)."""
        route = self.route(layer, x, segments, logits)
        return (experts or self.experts)(layer, x, *route, self.shared_expert(layer, x))

    def route(self, layer: int, x: torch.Tensor, segments: list[tuple[int, int]] | None = None,
              logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MoE layer `layer`'s routing of x [T, H]: (scores, topk_ids [T, k], topk_weights [T, k])."""
        if logits is None:
            return self.router(x, self.layers[layer], segments)
        return self.router.route(logits, x.dtype)

    def shared_expert(self, layer: int, x: torch.Tensor) -> Callable[[], torch.Tensor] | None:
        """MoE layer `layer`'s shared expert of x, to be computed when its executor asks (None: the family has
        none): resident like attention."""
        spec, w, kernels = self.spec, self.layers[layer], self.kernels
        if not spec.shared_expert_intermediate_size:
            return None

        def shared() -> torch.Tensor:
            out = kernels.swiglu(x, w["shared.gate_up_proj"], w["shared.down_proj"])
            if spec.shared_expert_gated:  # Qwen2-MoE: scaled by sigmoid(shared_expert_gate(x))
                return torch.sigmoid(F.linear(x, w["shared_gate"])) * out
            return out
        return shared

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """A layer without experts: its dense SwiGLU MLP."""
        w = self.layers[layer]
        return self.kernels.swiglu(x, w["mlp.gate_up_proj"], w["mlp.down_proj"])

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Logits [B, V] for each sequence's last token (or [N, V] for every token with all_logits)."""
        rope = self.ensure_rope(kv.max_len).tables(batch)
        self._step = (batch, kv, rope)
        if batch.decode and self.blocks is not None and self.blocks.applies(kv, rope, len(batch.rows_host)):
            return self._forward_blocks(batch, kv, rope)
        if batch.decode and self.graphs is not None:
            logits = self.graphs(batch, kv, rope)  # None where no graph applies to this step
            if logits is not None:
                return logits
        return self.run_layers(batch, kv, rope, self.experts, all_logits)

    def run_layers(self, batch: StepBatch, kv: KVCache, rope: RopeTables, experts: Experts,
                   all_logits: bool = False) -> torch.Tensor:
        """The step layer by layer, `experts` computing the MoE layers' experts: logits [B, V] (or [N, V])."""
        h = self.w["embed_tokens"][batch.token_ids]  # [N, H]
        segments = None if batch.decode else [(first, length) for _, first, _, length in batch.segments]
        delta = None
        for i in range(len(self.layers)):
            h, x = self.attend(i, h, delta, batch, kv, rope)
            self._h = h  # (a reference, no copy: what `lookahead` starts from)
            delta = self._moe(i, x, segments, experts=experts) if self.is_moe[i] else self._mlp(i, x)
        return self.head(h, delta, batch, all_logits)

    def attend(self, layer: int, h: torch.Tensor, delta: torch.Tensor | None, batch: StepBatch, kv: KVCache,
               rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s attention on the residual stream h [N, H], delta (the layer before's MLP or experts
        output, None for the first) added first -> (h, x): the residual after attention and its norm, the input of
        the layer's MLP or experts. Each residual add is fused with the norm after it (one launch on a GPU)."""
        w = self.layers[layer]
        h, x = self.add_norm(h, delta, w, "input_norm")
        return self.add_norm(h, self.attn[layer](x, batch, kv, rope), w, "post_attn_norm")

    def head(self, h: torch.Tensor, delta: torch.Tensor, batch: StepBatch, all_logits: bool = False) -> torch.Tensor:
        """Logits [B, V] of each sequence's last token (or [N, V] with all_logits) from the residual stream h and
        the last layer's output delta."""
        h = h + delta
        if not all_logits:
            h = h[batch.last]
        return self.kernels.linear(self.norm(h, self.w, "norm"), self.lm_head, self.lm_head_bias)

    def _forward_blocks(self, batch: StepBatch, kv: KVCache, rope: RopeTables) -> torch.Tensor:
        """A decode step (of up to BLOCK_ROWS sequences) with each layer's attention block in one native call: the
        same logits bit for bit (moetier/model/decode_block.py)."""
        blocks, rows = self.blocks, len(batch.rows_host)
        blocks.begin(kv, rope, batch.rows_host, [n - 1 for n in batch.lengths_host])
        h = blocks.residuals[:rows]  # [B, H], updated in place by each block
        torch.index_select(self.w["embed_tokens"], 0, batch.token_ids, out=h)
        tables = self._resident_tables() if rows == 1 else None  # (the one-call step: one sequence)
        if tables is not None:
            return self._forward_resident(kv, tables)
        delta = None  # the layer before's MLP or experts output, added by the next block
        for i in range(len(self.layers)):
            x, logits = blocks(i, delta, kv)
            self._h = h  # (the residual as it stands before this layer's experts: what `lookahead` starts from)
            if self.is_moe[i]:
                delta = self._moe(i, x, None, logits if blocks.fused_router[i] else None)
            else:
                delta = self._mlp(i, x)
        return self.kernels.linear(self.norm(h + delta, self.w, "norm"), self.lm_head, self.lm_head_bias)

    def _resident_tables(self):
        """The engine's tables of resident experts for this step, where the whole step can run in one call."""
        if self.resident_step is None or not hasattr(self.experts, "resident_tables"):
            return None
        return self.experts.resident_tables()

    def _forward_resident(self, kv: KVCache, tables) -> torch.Tensor:
        """Every layer in one native call (moetier/model/resident_step.py), then the engine hears each layer's
        route in order: the same logits bit for bit as the layers one by one."""
        step = self.resident_step
        step.bind(tables)
        step(kv)
        for i, (scores, topk_ids, topk_weights) in enumerate(step.routes):
            self.experts.heard(i, scores, topk_ids, topk_weights)
        return self.kernels.linear(self.norm(self.blocks.residual, self.w, "norm"), self.lm_head, self.lm_head_bias)

    def lookahead(self, layer: int, target: int) -> torch.Tensor:
        """Router logits [T, E] of MoE layer `target` for the tokens in flight, from the residual stream as it stands
        before MoE layer `layer`'s experts: the layers between run on it — attention with the KV cache, dense MLPs —
        without the experts of `layer` (SMoE's look-ahead, §IV-C). Only while `layer` runs, and `target` must be the
        next MoE layer (the MoE layers between could not run without their experts).

        The attention writes keys and values of this approximate state into the cache at the step's own positions;
        the real forward overwrites them at each of those layers before it reads them, so exact output holds."""
        if self._step is None or self._h is None:
            raise RuntimeError("lookahead runs only inside a forward step, while an MoE layer runs")
        if any(self.is_moe[i] for i in range(layer + 1, target)) or not self.is_moe[target]:
            raise ValueError(f"lookahead from layer {layer} reaches only the next MoE layer, not {target}")
        norm = self.norm
        batch, kv, rope = self._step
        h = self._h
        for i in range(layer + 1, target + 1):
            w = self.layers[i]
            h = h + self.attn[i](norm(h, w, "input_norm"), batch, kv, rope)
            if i < target:  # a dense layer between
                h = h + self._mlp(i, norm(h, w, "post_attn_norm"))
        w = self.layers[target]
        return self.router.logits(norm(h, w, "post_attn_norm"), w)
