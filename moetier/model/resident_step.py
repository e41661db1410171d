"""A one-sequence decode step through every layer in one native call (`csrc/decode_step.c`), where every expert is
resident: each layer's attention block (moetier/model/decode_block.py), the softmax router's choice (route.c) and
the token's experts from the layer's table of addresses (TokenTable) — what `Transformer._forward_blocks` calls
layer by layer, in its order, so the logits are the same bit for bit.

Why: layer by layer that is three native calls and the Python between, each run with the caches cold from the
weights just streamed (a bare ctypes call: 2.5 us warm, 37 us after a 100 MB read, on a Zen 4) — ~4.8 ms of a
~75 ms bf16 step on OLMoE-1B-7B. The router's outputs stay in buffers here, and the engine hears them after the
step, layer by layer in their order, as ResidentLayers would have (nothing is decided between layers when every
expert stays resident).

It applies where the blocks do, every layer is an MoE layer whose softmax router runs natively from the block's
logits (NativeSoftmaxRouter), there is no shared expert, and the engine hands over a table for every layer
(`resident_tables`: every expert resident, nothing but on-demand planning)."""

from __future__ import annotations

import ctypes

import torch

from moetier.config import ModelSpec
from moetier.model.decode_block import DecodeBlocks
from moetier.model.expert_kernels import TokenTable
from moetier.model.ggml_linear import GGML_BITS
from moetier.model.kv_cache import KVCache
from moetier.model.router import NativeSoftmaxRouter


class StepLayer(ctypes.Structure):
    """`moetier_step_layer`: one layer's block, cache rows, experts' table and the router's outputs."""

    _fields_ = [("block", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("table", ctypes.c_void_p)] + [(name, ctypes.c_long) for name in (
                    "bits", "intermediate", "gu_group", "d_group")] + [
        (name, ctypes.c_void_p) for name in ("logits", "scores", "ids", "weights", "x")]


class StepRoute(ctypes.Structure):
    """`moetier_step_route`: the softmax router's constants."""

    _fields_ = [(name, ctypes.c_long) for name in ("num_experts", "top_k", "norm", "round_bf16")] + [
        ("scale", ctypes.c_float)]


class ResidentStep:
    def __init__(self, spec: ModelSpec, blocks: DecodeBlocks, router: NativeSoftmaxRouter) -> None:
        self.spec, self.blocks, self.lib = spec, blocks, blocks.lib
        n, e, k = spec.num_layers, spec.num_experts, router.top_k
        dtype = torch.float32 if router.spec.fp32_weights else torch.bfloat16
        self.scores = torch.empty(n, 1, e, dtype=torch.float32)  # [L, 1, E] the router's, for the engine to hear
        self.ids = torch.empty(n, 1, k, dtype=torch.int64)  # [L, 1, k]
        self.weights = torch.empty(n, 1, k, dtype=dtype)  # [L, 1, k]
        self.routes = list(zip(self.scores, self.ids, self.weights))  # each layer's (scores, topk_ids, topk_weights)
        self.route = StepRoute(e, k, int(router.spec.norm_topk_prob), int(dtype == torch.bfloat16),
                               router.spec.scaling_factor)
        self.layers = (StepLayer * n)()
        for i, layer in enumerate(self.layers):
            layer.block, layer.logits, layer.x = blocks.addresses[i], blocks.logit_ptrs[i], blocks.x_ptrs[i]
            layer.scores, layer.ids = self.scores[i].data_ptr(), self.ids[i].data_ptr()
            layer.weights = self.weights[i].data_ptr()
        self.delta = torch.empty(1, spec.hidden_size, dtype=torch.bfloat16)  # [1, H] a layer's experts' output
        self.expert_scratch = torch.empty(0, dtype=torch.uint8)
        self.tables: list[TokenTable] | None = None

    @classmethod
    def make(cls, spec: ModelSpec, blocks: DecodeBlocks | None, router, is_moe: list[bool]) -> ResidentStep | None:
        """The step, or None where some layer is not block, native softmax router and routed SwiGLU experts alone."""
        if (blocks is None or not isinstance(router, NativeSoftmaxRouter) or not all(is_moe)
                or not all(blocks.fused_router) or spec.shared_expert_intermediate_size
                or spec.activation != "swiglu"):
            return None
        return cls(spec, blocks, router)

    def bind(self, tables: list[TokenTable]) -> None:
        """Each layer's experts from `tables` (the engine's, one a layer; bound again only when they change)."""
        if tables is self.tables:
            return
        h, k, need = self.spec.hidden_size, self.route.top_k, 0
        for layer, table in zip(self.layers, tables, strict=True):
            i = table.shape[1]
            groups = table.shape[2:] if table.bits not in (16, GGML_BITS) else (0, 0)
            layer.table, layer.bits, layer.intermediate = table.ptrs.ctypes.data, table.bits, i
            layer.gu_group, layer.d_group = groups
            need = max(need, 4 * (h + k * (i + h)) if table.bits == 16 else
                       self.lib.moetier_gq_token_scratch(k, h, i) if table.bits == GGML_BITS else
                       self.lib.moetier_swiglu_qi_token_scratch(table.bits, *groups, h, i, k))
        if self.expert_scratch.numel() < need:
            self.expert_scratch = torch.empty(need, dtype=torch.uint8)
        self.tables = tables  # (held: the addresses above point into them)

    def __call__(self, kv: KVCache) -> None:
        """The step, after `blocks.begin` and the token's embedding written into `blocks.residual`: the residual
        stream after the last layer's experts (before the final norm) in `blocks.residual`, each layer's route in
        `routes`, the KV cache written."""
        blocks = self.blocks
        for i, layer in enumerate(self.layers):
            layer.k_cache = kv.k[i].data_ptr() + blocks.row_bytes
            layer.v_cache = kv.v[i].data_ptr() + blocks.row_bytes
        self.lib.moetier_decode_step_resident(
            len(self.layers), ctypes.addressof(self.layers), ctypes.addressof(self.route), blocks.residual_ptr,
            self.spec.hidden_size, blocks.max_len, blocks.position, blocks.cos, blocks.sin, self.delta.data_ptr(),
            blocks.work_ptr, blocks.scratch_ptr, self.expert_scratch.data_ptr())
