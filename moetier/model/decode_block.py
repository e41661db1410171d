"""A one-sequence decode step's attention blocks, each in one native call (`csrc/decode_block.c`): the residual
add of the layer before, the norms, the stacked q/k/v product, RoPE, the KV write, the attention, the output
product, the router's product — what `Transformer.forward` does between two expert calls.

Why: at batch 1 those are ~10 calls a layer through Python, ctypes and torch (views, `empty`, `data_ptr`, the
residual adds), each run with the caches cold from the weights streamed just before. On OLMoE-1B-7B (Zen 4) a
resident step's time outside the native calls fell from ~8 to ~6 ms in bf16 and from ~5 to ~3 ms with int4 (the
step 3% and 9% faster, bench/alternate_steps.py). The block calls the same kernels on the same values in the same
order, so the logits are the same bit for bit (tests/model/test_decode_block.py).

It applies where those kernels would all run natively anyway: bf16 weights on the native kernels, or quantized
attention products (`--dense-precision`) that their integer kernel computes, or a GGUF's own blocks (q, k and v
apart, each in its type); RMSNorm, standard grouped-query
attention with stacked q/k/v (no sinks, no latent attention, no q/k/v clamp), whole-head RoPE in halves, and a KV
cache in the model's dtype. Elsewhere `make` returns None and the layer-by-layer forward runs."""

from __future__ import annotations

import ctypes

import torch

from moetier.config import ModelSpec
from moetier.model.attention import Attention
from moetier.model.dense_quant import BlockMatrix, QuantizedDenseKernels, QuantizedMatrix
from moetier.model.ggml_linear import GGML_BITS, TYPE_IDS
from moetier.model.kernels import NativeKernels
from moetier.model.kv_cache import KVCache
from moetier.model.rope import RopeTables
from moetier.model.router import SoftmaxRouter

QK_NORM = {"none": 0, "full": 1, "head": 2}  # the C side's codes (moetier_decode_layer.qk_norm)


class Matrix(ctypes.Structure):
    """`moetier_matrix`: a product's bf16 weight (bits 16) or quantized codes, scales and zeros; its bias."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("weight", "scales", "zeros", "bias")] + [
        ("bits", ctypes.c_long), ("group", ctypes.c_long)]


class DecodeLayer(ctypes.Structure):
    """`moetier_decode_layer`: one layer's norms, products and shapes."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("input_norm", "q_norm", "k_norm", "post_attn_norm")] + [
        (name, Matrix) for name in ("qkv_proj", "o_proj", "router")] + [(name, ctypes.c_long) for name in (
            "hidden", "heads", "kv_heads", "head_dim", "num_experts", "qk_norm", "window")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _bf16(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous()


def _base(kernels):
    """The native kernels under `kernels` (QuantizedDenseKernels wraps them), or None."""
    base = kernels.base if isinstance(kernels, QuantizedDenseKernels) else kernels
    return base if isinstance(base, NativeKernels) else None


def _product(weight, lib) -> bool:
    """Whether the block computes this product as the kernels' `linear` does: bf16 rows, a quantized matrix
    their integer kernel takes (QuantizedDenseKernels' own test), or a GGUF's blocks (one matrix, or q/k/v)."""
    if isinstance(weight, tuple):
        return all(_product(part, lib) for part in weight)
    if isinstance(weight, BlockMatrix):
        return weight.fmt in TYPE_IDS and bool(lib.moetier_gq_fits(TYPE_IDS[weight.fmt], weight.shape[1]))
    if isinstance(weight, QuantizedMatrix):
        return bool(lib.moetier_qi_fits(weight.bits, weight.shape[1], weight.group))
    return _bf16(weight)


def _qkv(a: Attention):
    """The layer's q/k/v product: stacked (stacked.py), or a GGUF's three block matrices side by side (their
    types may differ, so they are not stacked: the block computes each part in its own); None otherwise."""
    if a.qkv_proj is not None:
        return a.qkv_proj
    parts = (a.q_proj, a.k_proj, a.v_proj)
    return parts if all(isinstance(p, BlockMatrix) for p in parts) else None


def _qkv_bias(a: Attention) -> torch.Tensor | None:
    """The q/k/v bias over the stacked product's rows (the three biases one after another where apart)."""
    if a.qkv_proj is not None or a.q_bias is None:
        return a.qkv_bias if a.qkv_proj is not None else None
    return torch.cat([a.q_bias, a.k_bias, a.v_bias]).contiguous()


def _fits(spec: ModelSpec, embed: torch.Tensor, attn: list, layers: list[dict[str, torch.Tensor]], kernels) -> bool:
    """Whether every layer's attention block is what the native block computes, on the kernels it calls."""
    base = _base(kernels)
    if base is None or spec.norm != "rms" or spec.clip_qkv is not None or not _bf16(embed):
        return False
    if spec.qk_norm not in QK_NORM:
        return False
    for a, w in zip(attn, layers):
        if type(a) is not Attention or _qkv(a) is None:
            return False
        biases = [] if a.qkv_proj is not None else [a.q_bias, a.k_bias, a.v_bias]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            return False  # some of q/k/v biased, not all
        tensors = [w["input_norm"], w["post_attn_norm"]]
        tensors += [t for t in (_qkv_bias(a), a.o_bias, a.q_norm, a.k_norm) if t is not None]
        if not all(_bf16(t) for t in tensors) or not all(_product(m, base.lib) for m in (_qkv(a), a.o_proj)):
            return False
    return True


def _router_fused(router, w: dict[str, torch.Tensor]) -> bool:
    """Whether the router is exactly `route(linear(x))` with a bf16 product (its logits made in the block)."""
    weight = w.get("router")
    return (type(router).__call__ is SoftmaxRouter.__call__ and not router.spec.fp32 and _bf16(weight)
            and (w.get("router.bias") is None or _bf16(w["router.bias"])))


def _matrix(weight, bias: torch.Tensor | None) -> Matrix:
    if isinstance(weight, BlockMatrix):
        weight = (weight,)
    if isinstance(weight, tuple):  # a GGUF's blocks: up to three parts, their types four bits each
        ptrs = [p.data.data_ptr() for p in weight] + [None] * (3 - len(weight))
        types = sum(TYPE_IDS[p.fmt] << (4 * i) for i, p in enumerate(weight))
        return Matrix(*ptrs, _ptr(bias), GGML_BITS, types)
    if isinstance(weight, QuantizedMatrix):
        q = weight.q
        return Matrix(q.codes.data_ptr(), q.scales.data_ptr(), _ptr(q.zeros), _ptr(bias), weight.bits, weight.group)
    return Matrix(_ptr(weight), None, None, _ptr(bias), 16, 0)


class DecodeBlocks:
    def __init__(self, spec: ModelSpec, attn: list[Attention], layers: list[dict[str, torch.Tensor]], router,
                 is_moe: list[bool], kernels) -> None:
        self.spec, self.lib = spec, _base(kernels).lib
        h, d = spec.hidden_size, spec.head_dim
        self.held: list[torch.Tensor] = []  # tensors made here that the layers' structures point at
        self.fused_router = [is_moe[i] and _router_fused(router, w) for i, w in enumerate(layers)]
        self.layers = [self._layer(a, w, fused) for a, w, fused in zip(attn, layers, self.fused_router)]
        self.addresses = [ctypes.addressof(layer) for layer in self.layers]
        n = len(layers)
        self.residual = torch.empty(1, h, dtype=torch.bfloat16)  # [1, H] updated in place, layer by layer
        self.x = torch.empty(n, 1, h, dtype=torch.bfloat16)  # each layer's normed input to its MLP or experts
        # [L, 1, E] the router's bf16 logits as floats: exactly what its softmax in fp32 would widen them to
        self.logits = torch.empty(n, 1, spec.num_experts or 1, dtype=torch.float32)
        self.work = torch.empty(2 * h + 4 * (spec.num_heads + spec.num_kv_heads) * d + (spec.num_experts or 1),
                                dtype=torch.bfloat16)
        self.scratch = torch.empty(0, dtype=torch.float32)  # the products' and the attention's, grown to the context
        # each layer's views and addresses, made once: two views and four `data_ptr`s a call, run with the caches
        # cold from the weights just streamed, were ~1% of a resident bf16 step's samples (py-spy, OLMoE, Zen 4)
        self.xs, self.logit_rows = list(self.x), list(self.logits)
        self.x_ptrs, self.logit_ptrs = [x.data_ptr() for x in self.xs], [r.data_ptr() for r in self.logit_rows]
        self.residual_ptr, self.work_ptr = self.residual.data_ptr(), self.work.data_ptr()
        products = [self._scratch(_qkv(a)) for a in attn] + [self._scratch(a.o_proj) for a in attn]
        self.products = max(*products, h + (spec.num_experts or 1))  # floats for the largest product (router's too)

    @classmethod
    def make(cls, spec: ModelSpec, embed: torch.Tensor, attn: list, layers: list[dict[str, torch.Tensor]], router,
             is_moe: list[bool], kernels) -> DecodeBlocks | None:
        """The blocks, or None where some layer's attention is not what they compute."""
        if not _fits(spec, embed, attn, layers, kernels):
            return None
        return cls(spec, attn, layers, router, is_moe, kernels)

    def _scratch(self, weight) -> int:
        """Floats a product of `weight` needs: K + N for bf16 rows, the integer kernel's bytes for a quantized one."""
        if isinstance(weight, BlockMatrix):
            weight = (weight,)
        if isinstance(weight, tuple):  # K + N floats and the largest part's activation bytes (product_ggml)
            k = weight[0].shape[1]
            act = max(self.lib.moetier_gq_act_bytes(TYPE_IDS[p.fmt], k) for p in weight)
            return k + sum(p.shape[0] for p in weight) + act // 4 + 1
        n, k = weight.shape
        if isinstance(weight, QuantizedMatrix):
            return self.lib.moetier_linear_qi_scratch(weight.bits, weight.group, n, k, 1) // 4 + 1
        return n + k

    def _layer(self, a: Attention, w: dict[str, torch.Tensor], fused_router: bool) -> DecodeLayer:
        spec = self.spec
        router = _matrix(w["router"], w.get("router.bias")) if fused_router else Matrix()
        qkv_bias = _qkv_bias(a)
        if qkv_bias is not None:
            self.held.append(qkv_bias)  # (the block reads it by address)
        return DecodeLayer(
            _ptr(w["input_norm"]), _ptr(a.q_norm), _ptr(a.k_norm), _ptr(w["post_attn_norm"]),
            _matrix(_qkv(a), qkv_bias), _matrix(a.o_proj, a.o_bias), router, spec.hidden_size, spec.num_heads,
            spec.num_kv_heads, spec.head_dim, spec.num_experts or 1, QK_NORM[spec.qk_norm], a.window or 0,
            spec.rms_norm_eps, a.scale)

    def applies(self, kv: KVCache, rope: RopeTables, rows: int) -> bool:
        """For this step: one sequence, whole-head RoPE, a cache the kernel writes (checked once a step)."""
        k = kv.k[0]
        return (rows == 1 and rope.plain(self.spec.head_dim) and k.dtype == torch.bfloat16 and k.is_contiguous()
                and kv.v[0].is_contiguous())

    def begin(self, kv: KVCache, rope: RopeTables, row: int, position: int) -> None:
        """The step's places: its cache row, its position's RoPE rows, and the work space for its context."""
        heads, max_len, d = kv.k[0].shape[1:]
        self.row_bytes = row * heads * max_len * d * 2  # bf16
        self.max_len, self.position = max_len, position
        offset = position * d * 2
        self.cos, self.sin = rope.cos.data_ptr() + offset, rope.sin.data_ptr() + offset
        need = max(self.products, self.lib.moetier_threads() * (position + 1 + 2 * d))  # (attention: a part a thread)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(max(need, 2 * self.scratch.numel()), dtype=torch.float32)
        self.scratch_ptr = self.scratch.data_ptr()

    def __call__(self, layer: int, delta: torch.Tensor | None, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += delta (the layer before's MLP or experts, None at the first), then += the attention: returns
        (x [1, H], the post-attention norm of the residual; logits [1, E] fp32 of a fused router, else unset)."""
        if delta is not None:
            delta = delta.contiguous()  # (held: its pointer must outlive the call)
        self.lib.moetier_decode_block_bf16(
            self.addresses[layer], self.residual_ptr, None if delta is None else delta.data_ptr(),
            kv.k[layer].data_ptr() + self.row_bytes, kv.v[layer].data_ptr() + self.row_bytes, self.max_len,
            self.position, self.cos, self.sin, self.x_ptrs[layer], self.logit_ptrs[layer], self.work_ptr,
            self.scratch_ptr)
        return self.xs[layer], self.logit_rows[layer]
