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

import numpy as np
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
# the most sequences a step's blocks take (a server's batch, moetier_decode_block_rows): within every precision's
# integer_tokens (gemm_precision.py: Q8_0's 12 the least), so the layer-by-layer forward would compute the same
# products from the codes, and within the native decode attention's rows (kernels.NATIVE_ROWS)
BLOCK_ROWS = 8


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
        n, e = len(layers), spec.num_experts or 1
        # [B, H] updated in place, layer by layer (a step of one sequence: its first row, `residual`)
        self.residuals = torch.empty(BLOCK_ROWS, h, dtype=torch.bfloat16)
        self.residual = self.residuals[:1]
        self.x = torch.empty(n, BLOCK_ROWS, h, dtype=torch.bfloat16)  # each layer's normed input to its experts
        # [L, B, E] the router's bf16 logits as floats: exactly what its softmax in fp32 would widen them to
        self.logits = torch.empty(n, BLOCK_ROWS, e, dtype=torch.float32)
        row_work = 2 * h + 4 * (spec.num_heads + spec.num_kv_heads) * d + e  # bf16 values a sequence's block uses
        self.work = torch.empty(BLOCK_ROWS * row_work, dtype=torch.bfloat16)
        self.scratch = torch.empty(0, dtype=torch.float32)  # the products' and the attention's, grown to the context
        self.rows = 1  # the step's sequences (`begin`)
        # each layer's views and addresses, made once: two views and four `data_ptr`s a call, run with the caches
        # cold from the weights just streamed, were ~1% of a resident bf16 step's samples (py-spy, OLMoE, Zen 4)
        self.xs, self.logit_rows = list(self.x[:, :1]), list(self.logits[:, :1])
        self.views: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # B -> each layer's x, logits
        self.x_ptrs, self.logit_ptrs = [x.data_ptr() for x in self.xs], [r.data_ptr() for r in self.logit_rows]
        self.residual_ptr, self.work_ptr = self.residual.data_ptr(), self.work.data_ptr()
        products = [self._scratch(_qkv(a)) for a in attn] + [self._scratch(a.o_proj) for a in attn]
        self.products = max(*products, h + e)  # floats for the largest product (router's too)
        # ...and of a batch's (moetier_decode_block_rows' product_rows)
        self.products_rows = max(*(self._scratch(m, BLOCK_ROWS) for a in attn for m in (_qkv(a), a.o_proj)),
                                 BLOCK_ROWS * h)

    @classmethod
    def make(cls, spec: ModelSpec, embed: torch.Tensor, attn: list, layers: list[dict[str, torch.Tensor]], router,
             is_moe: list[bool], kernels) -> DecodeBlocks | None:
        """The blocks, or None where some layer's attention is not what they compute."""
        if not _fits(spec, embed, attn, layers, kernels):
            return None
        return cls(spec, attn, layers, router, is_moe, kernels)

    def _scratch(self, weight, rows: int = 1) -> int:
        """Floats a product of `weight` needs for `rows` rows: K + N a row for bf16 (K for more rows), the integer
        kernel's bytes for a quantized one, K + N floats and an activation's bytes a row for GGUF blocks."""
        if isinstance(weight, BlockMatrix):
            weight = (weight,)
        if isinstance(weight, tuple):  # (product_ggml, product_rows)
            k = weight[0].shape[1]
            act = max(self.lib.moetier_gq_act_bytes(TYPE_IDS[p.fmt], k) for p in weight)
            return rows * (k + sum(p.shape[0] for p in weight) + act // 4 + 1)
        n, k = weight.shape
        if isinstance(weight, QuantizedMatrix):
            return self.lib.moetier_linear_qi_scratch(weight.bits, weight.group, n, k, rows) // 4 + 1
        return n + k if rows == 1 else rows * k

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
        """For this step: up to BLOCK_ROWS sequences, whole-head RoPE, a cache the kernel writes (checked once a
        step)."""
        k = kv.k[0]
        return (rows <= BLOCK_ROWS and rope.plain(self.spec.head_dim) and k.dtype == torch.bfloat16
                and k.is_contiguous() and kv.v[0].is_contiguous())

    def begin(self, kv: KVCache, rope: RopeTables, rows: list[int], positions: list[int]) -> None:
        """The step's places: each sequence's cache row, its position's RoPE rows, and the work space for the
        longest context."""
        heads, max_len, d = kv.k[0].shape[1:]
        self.rows = len(rows)
        row_bytes = [row * heads * max_len * d * 2 for row in rows]  # bf16
        self.row_bytes, self.max_len, self.position = row_bytes[0], max_len, positions[0]
        offsets = [position * d * 2 for position in positions]
        self.cos, self.sin = rope.cos.data_ptr() + offsets[0], rope.sin.data_ptr() + offsets[0]
        if self.rows > 1:  # (moetier_decode_block_rows' arrays: a sequence's row, position and RoPE rows each)
            self.row_array = np.array(row_bytes, dtype=np.int64)
            self.position_array = np.array(positions, dtype=np.int64)
            self.rope_array = np.array([[rope.cos.data_ptr() + o for o in offsets],
                                        [rope.sin.data_ptr() + o for o in offsets]], dtype=np.int64)  # [2, B]
        products = self.products if self.rows == 1 else self.products_rows
        need = max(products, self.lib.moetier_threads() * (max(positions) + 1 + 2 * d))  # (attention: a thread's)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(max(need, 2 * self.scratch.numel()), dtype=torch.float32)
        self.scratch_ptr = self.scratch.data_ptr()

    def rows_of(self, rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each layer's x [B, H] and logits [B, E] for a step of `rows` sequences (views, made once per B)."""
        if rows == 1:
            return self.xs, self.logit_rows
        if rows not in self.views:
            self.views[rows] = list(self.x[:, :rows]), list(self.logits[:, :rows])
        return self.views[rows]

    def __call__(self, layer: int, delta: torch.Tensor | None, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += delta (the layer before's MLP or experts, None at the first), then += the attention: returns
        (x [B, H], the post-attention norm of the residual; logits [B, E] fp32 of a fused router, else unset)."""
        if delta is not None:
            delta = delta.contiguous()  # (held: its pointer must outlive the call)
        if self.rows > 1:
            return self._rows(layer, delta, kv)
        self.lib.moetier_decode_block_bf16(
            self.addresses[layer], self.residual_ptr, None if delta is None else delta.data_ptr(),
            kv.k[layer].data_ptr() + self.row_bytes, kv.v[layer].data_ptr() + self.row_bytes, self.max_len,
            self.position, self.cos, self.sin, self.x_ptrs[layer], self.logit_ptrs[layer], self.work_ptr,
            self.scratch_ptr)
        return self.xs[layer], self.logit_rows[layer]

    def _rows(self, layer: int, delta: torch.Tensor | None, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's sequences through the layer's block in one call (moetier_decode_block_rows)."""
        xs, logits = self.rows_of(self.rows)
        ropes = self.rope_array
        self.lib.moetier_decode_block_rows(
            self.addresses[layer], self.rows, self.residual_ptr, None if delta is None else delta.data_ptr(),
            kv.k[layer].data_ptr(), kv.v[layer].data_ptr(), self.row_array.ctypes.data, self.max_len,
            self.position_array.ctypes.data, ropes.ctypes.data, ropes.ctypes.data + ropes.strides[0],
            xs[layer].data_ptr(), logits[layer].data_ptr(), self.work_ptr, self.scratch_ptr)
        return xs[layer], logits[layer]
