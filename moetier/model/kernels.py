"""The arithmetic a forward step is made of, behind one interface: `linear` (F.linear), `swiglu`, `expert` (a
SwiGLU expert on its tokens, scaled by their routing weights, written into `out`), `rms_norm`, `rope` and
`decode_attention` (one new token per sequence against its KV cache); `expert_layer`: several experts of a layer at
once.

`TorchKernels` is torch's own ops; `CudaKernels` the same on a GPU, decode attention kept off cuDNN; `TritonKernels`
(`auto` where triton is installed) a layer's SwiGLU experts and a bf16 model's norms and rotations in Triton besides.
`NativeKernels` takes bf16 on the CPU to `csrc/bf16_rows.c`: a batch-1 decode step's products at the memory's speed,
and a batch's or a prefill's rows with each weight row read once for all of them (each row bit for bit what it
computes alone); prefill attention, rope of a batch, and fp32 stay on torch.
Chosen once per engine by `make_kernels`, never per call by a flag."""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F

from moetier.config import KERNELS
from moetier.errors import MoetierError
from moetier.model import native
from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.model.layers import rms_norm, rms_norm_fp32_weight
from moetier.model.rope import RopeTables

NATIVE_ROWS = 16  # decode rows the native attention takes one by one (a server's batch); more go to torch's SDPA
LINEAR_ROWS = 256  # rows of one native product call (a prefill's more: in calls of this many, scratch T x K floats)
LAYER_SCRATCH_BYTES = 64 << 20  # a layer call's fp32 work space at most (a long prefill's experts: in several calls)


class Fp32Buffer:
    """A tensor's values as fp32 (exact for bf16 ones) in one buffer kept across calls, grown to the largest seen:
    routing weights for the native calls, which read floats, without an allocation a call."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.float32)

    def of(self, t: torch.Tensor) -> torch.Tensor:
        if self.buf.numel() < t.numel():
            self.buf = torch.empty(t.numel(), dtype=torch.float32)
        out = self.buf[:t.numel()]
        out.copy_(t)
        return out


class TorchKernels:
    name = "torch"
    # whether a step's positions and KV rows are read from its tensors alone, never from the batch's host copies
    # (what a CUDA graph replays: moetier/model/decode_graphs.py); NativeKernels take one token's from the host
    positions_on_device = True

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def swiglu(self, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)) with gate and up packed as gate_up_proj [2I, H]."""
        gate, up = F.linear(x, gate_up_proj).chunk(2, dim=-1)  # [n, I] each
        return F.linear(F.silu(gate) * up, down_proj)

    def expert(self, out: torch.Tensor, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
               weights: torch.Tensor) -> None:
        """out [n, H] = swiglu(x [n, H]) * weights [n] (rounded as the reference's two ops round)."""
        out.copy_(self.swiglu(x, gate_up_proj, down_proj) * weights[:, None])

    def expert_layer(self, ys: torch.Tensor, xs: torch.Tensor, weights: torch.Tensor,
                     items: list[tuple[torch.Tensor, torch.Tensor, int, int]]) -> None:
        """Several experts of a layer: for each (gate_up_proj, down_proj, a, b), rows a:b of ys [P, H] =
        `expert` on rows a:b of xs [P, H] and weights [P] — here one call each."""
        for gate_up_proj, down_proj, a, b in items:
            self.expert(ys[a:b], xs[a:b], gate_up_proj, down_proj, weights[a:b])

    def expert_token(self, out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor,
                     items: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One token x [1, H] through a layer's experts (gate_up_proj, down_proj), ascending ids, weights [n]: out
        [1, H] = their outputs summed — `expert_layer` on copies of the row, then `combine`."""
        n = len(items)
        xs = x.expand(n, x.shape[1]).contiguous()  # [n, H]
        ys = torch.empty_like(xs)
        self.expert_layer(ys, xs, weights, [(gu, d, e, e + 1) for e, (gu, d) in enumerate(items)])
        out.copy_(self.combine(x, torch.zeros(n, dtype=torch.long, device=x.device), ys))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Over the last dimension."""
        return rms_norm(x, weight, eps)

    def rms_norm_fp32_weight(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """gpt-oss's: the weight applied in fp32, one cast at the end."""
        return rms_norm_fp32_weight(x, weight, eps)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream h + delta [T, H] and its RMSNorm (the reference's two ops, one after the other)."""
        h = h + delta
        return h, self.rms_norm(h, weight, eps)

    def add_rms_norm_fp32_weight(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_rms_norm` with gpt-oss's norm (`rms_norm_fp32_weight`)."""
        h = h + delta
        return h, self.rms_norm_fp32_weight(h, weight, eps)

    def combine(self, x: torch.Tensor, token_of: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        """Each token's expert outputs summed: [T, H] from ys [P, H], row p belonging to token token_of[p] (the
        reference's index_add_ into zeros, in the order the rows come)."""
        return torch.zeros_like(x).index_add_(0, token_of, ys)

    def rope(self, rope: RopeTables, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """x [N, heads, D] rotated to each token's position."""
        return rope(x, batch.positions)

    def kv_write(self, kv: KVCache, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's keys and values k, v [N, kv_heads, D] into the layer's cache at its tokens' places."""
        kv.write(layer, batch.rows, batch.positions, k, v)

    def sink_decode_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: StepBatch,
                              window: int | None, scale: float, sinks: torch.Tensor) -> torch.Tensor | None:
        """`decode_attention` with gpt-oss's sink logit per head [Hq] (one more in each head's softmax, weighting no
        value), where these kernels have it (the native ones, bf16); None: the caller's own (SinkAttention)."""
        return None

    def decode_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: StepBatch,
                         window: int | None, scale: float) -> torch.Tensor:
        """q [B, Hq, D] (one token per row), keys/values [R, Hkv, S_max, D] the layer's cache -> [B, Hq, D]."""
        s = max(batch.lengths_host)
        keys, values = keys[:, :, :s], values[:, :, :s]  # views
        if not batch.all_rows:  # some sequences finished: gather the live rows
            keys, values = keys.index_select(0, batch.rows), values.index_select(0, batch.rows)
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=batch.decode_mask(window),
                                             scale=scale, enable_gqa=True)  # [B, Hq, 1, D]
        return out[:, :, 0, :]


class CudaKernels(TorchKernels):
    """torch's ops on a GPU, with decode attention kept off cuDNN's SDPA backend. torch prefers cuDNN for a masked
    bf16 decode on Hopper, and cuDNN builds an execution plan per shape — with the KV length growing every step, a
    new one each call: 11.6 ms a call under the profiler on the H200 (96 such calls made more than half of a 7-step
    OLMoE-1B-7B decode; bench/gpu/results/2026-11-27-h200/profile-olmoe.json). The memory-efficient kernel takes
    any mask and has no plan to build; flash and math stay as fallbacks (fp32, shapes it cannot take).
    The experts through torch's ops too (`--kernels torch`, or triton not installed); `triton` says whether a
    layer's SwiGLU experts go to Triton (TritonKernels; moetier/model/expert_kernels.py `_on_triton`)."""

    name = "cuda"
    triton = False

    def __init__(self) -> None:
        from torch.nn.attention import SDPBackend

        self.decode_backends = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]

    def decode_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: StepBatch,
                         window: int | None, scale: float) -> torch.Tensor:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(self.decode_backends):
            return super().decode_attention(q, keys, values, batch, window, scale)


class TritonKernels(CudaKernels):
    """CudaKernels where triton is installed (`--kernels auto`): a layer's bf16 and quantized SwiGLU experts in two
    Triton launches (moetier/model/triton_experts.py); a bf16 model's RMSNorms (with the residual add before each;
    gpt-oss's, its weight applied in fp32, too) and rotations one launch each instead of eight (nine) and seven,
    and its keys and values into the cache in one instead of two (moetier/model/triton_dense.py: the same values as
    torch's ops — a rotation, an add and the writes bit for bit, a norm but for the order of its sum of squares).
    What those kernels do not take — another dtype, a view whose rows are not contiguous — goes to torch's ops."""

    name = "triton"
    triton = True

    def __init__(self) -> None:
        super().__init__()
        from moetier.model import triton_dense

        self.dense = triton_dense

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._takes_norm(x, weight):
            return super().rms_norm(x, weight, eps)
        return self.dense.rms_norm(x, weight, eps)

    def rms_norm_fp32_weight(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._takes_norm(x, weight):
            return super().rms_norm_fp32_weight(x, weight, eps)
        return self.dense.rms_norm(x, weight, eps, fp32_weight=True)

    def _takes_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and self.dense.takes_norm_of(x)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._takes_add_norm(h, delta, weight):
            return super().add_rms_norm(h, delta, weight, eps)
        return self.dense.add_rms_norm(h, delta, weight, eps)

    def add_rms_norm_fp32_weight(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._takes_add_norm(h, delta, weight):
            return super().add_rms_norm_fp32_weight(h, delta, weight, eps)
        return self.dense.add_rms_norm(h, delta, weight, eps, fp32_weight=True)

    @staticmethod
    def _takes_add_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> bool:
        return (h.dtype == delta.dtype == weight.dtype == torch.bfloat16 and h.dim() == 2 and h.shape == delta.shape
                and h.is_contiguous() and delta.is_contiguous())

    def rope(self, rope: RopeTables, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or rope.cos.dtype != torch.bfloat16 or not x.is_contiguous():
            return super().rope(rope, x, batch)
        return self.dense.rope(rope, x, batch.positions)

    def kv_write(self, kv: KVCache, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        keys, values = kv.k[layer], kv.v[layer]
        if k.dtype != torch.bfloat16 or not self.dense.takes_kv_write(keys, values, k, v):
            return super().kv_write(kv, layer, batch, k, v)
        self.dense.kv_write(keys, values, batch.rows, batch.positions, k, v)


class NativeKernels(TorchKernels):
    """bf16 on the CPU: products, experts and norms of any number of rows (a decode step, a server's batch of them,
    a prefill) in the native library — each weight row read once for all the rows, fp32 accumulation, one rounding
    per op as torch's; only the order of the sums differs, and a row's result does not depend on the others in its
    batch. Decode attention too, one sequence at a time up to NATIVE_ROWS of them; a prefill's stays torch's."""

    name = "native"
    positions_on_device = False  # a decode token's rope, KV write and attention from the batch's host copies

    def __init__(self, lib, isa: str = "") -> None:
        self.lib, self.isa = lib, isa  # isa: the instruction set the library was built for (native.ISAS)
        self.scratch = torch.empty(0, dtype=torch.float32)  # fp32 work space, grown to the largest shape seen
        self.route_weights = Fp32Buffer()
        self.ones = torch.ones(0, dtype=torch.float32)  # the weights of an expert that is not routed

    def _scratch(self, floats: int) -> int:
        if self.scratch.numel() < floats:
            self.scratch = torch.empty(floats, dtype=torch.float32)
        return self.scratch.data_ptr()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if x.dim() != 2 or not x.is_contiguous():
            return F.linear(x, weight, bias)
        n, k = weight.shape
        y = torch.empty(rows, n, dtype=x.dtype)
        b = None if bias is None else bias.data_ptr()
        if rows == 1:
            self.lib.moetier_linear_bf16(weight.data_ptr(), x.data_ptr(), b, y.data_ptr(), n, k, self._scratch(k + n))
            return y
        for first in range(0, rows, LINEAR_ROWS):  # (a prefill's rows: the weights read once a chunk)
            t = min(LINEAR_ROWS, rows - first)
            self.lib.moetier_linear_bf16_rows(weight.data_ptr(), x[first].data_ptr(), b, y[first].data_ptr(), n, k,
                                              t, self._scratch(t * k))
        return y

    def swiglu(self, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.dim() != 2 or not x.is_contiguous():
            return super().swiglu(x, gate_up_proj, down_proj)
        y = torch.empty_like(x)
        if rows == 1:
            self._swiglu_row(y, x, gate_up_proj, down_proj, 1.0)
        else:
            if self.ones.numel() < rows:
                self.ones = torch.ones(rows, dtype=torch.float32)
            self._layer(y, x, self.ones[:rows], [(gate_up_proj, down_proj, 0, rows)])
        return y

    def expert(self, out: torch.Tensor, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
               weights: torch.Tensor) -> None:
        rows = x.shape[0]
        if not (x.is_contiguous() and out.is_contiguous()):
            return super().expert(out, x, gate_up_proj, down_proj, weights)
        if rows == 1:
            # The weight times the bf16 output in fp32, rounded once: what `swiglu(x) * w` then the bf16 `out`
            # store round to, whether the router's weights are bf16 or fp32 (Mixtral).
            self._swiglu_row(out, x, gate_up_proj, down_proj, weights.item())
        else:
            self._layer(out, x, self.route_weights.of(weights), [(gate_up_proj, down_proj, 0, rows)])

    def expert_layer(self, ys: torch.Tensor, xs: torch.Tensor, weights: torch.Tensor,
                     items: list[tuple[torch.Tensor, torch.Tensor, int, int]]) -> None:
        """A layer's experts, each on its rows of xs, in one native call: bit for bit what `expert` computes for
        each (one parallel region a layer instead of one an expert)."""
        if not (xs.is_contiguous() and ys.is_contiguous()):
            return super().expert_layer(ys, xs, weights, items)
        self._layer(ys, xs, self.route_weights.of(weights), items)

    def expert_token(self, out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor,
                     items: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """In one native call (moetier_swiglu_bf16_token: the row converted once, the outputs summed as `combine`
        sums them): bit for bit what `expert_layer` on copies of the row and `combine` give."""
        h, i = items[0][1].shape
        if not (x.is_contiguous() and out.is_contiguous()) or x.shape[0] != 1:
            return super().expert_token(out, x, weights, items)
        ptrs = np.array([[gu.data_ptr() for gu, _ in items], [d.data_ptr() for _, d in items]],
                        dtype=np.int64)  # [2, n]: gate_up, down
        self.swiglu_token(out, x, self.route_weights.of(weights).data_ptr(), ptrs, i)

    def swiglu_token(self, out: torch.Tensor, x: torch.Tensor, weights: int, ptrs: np.ndarray, i: int) -> None:
        """moetier_swiglu_bf16_token: x, out [1, H] contiguous; `weights` the address of n fp32 routing weights;
        ptrs [2, n] contiguous: each expert's gate_up_proj and down_proj addresses; `i` the intermediate size."""
        n, h = ptrs.shape[1], x.shape[1]
        p = ptrs.ctypes.data
        self.lib.moetier_swiglu_bf16_token(n, p, p + ptrs.strides[0], x.data_ptr(), weights, out.data_ptr(), h, i,
                                           self._scratch(h + n * (i + h)))

    def swiglu_token_routed(self, out: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                            topk_weights: torch.Tensor, table: np.ndarray, i: int) -> None:
        """moetier_swiglu_bf16_token_routed: one token's experts straight from the router's topk_ids [1, k] int64
        and topk_weights [1, k] (fp32 or bf16), contiguous; table [E, 2] contiguous: each expert's gate_up_proj and
        down_proj addresses; x, out [1, H] contiguous; `i` the intermediate size."""
        k, h = topk_ids.shape[1], x.shape[1]
        self.lib.moetier_swiglu_bf16_token_routed(
            table.ctypes.data, topk_ids.data_ptr(), topk_weights.data_ptr(), 32 if topk_weights.dtype == torch.float32
            else 16, k, x.data_ptr(), out.data_ptr(), h, i, self._scratch(h + k * (i + h)))

    def _layer(self, ys: torch.Tensor, xs: torch.Tensor, weights: torch.Tensor,
               items: list[tuple[torch.Tensor, torch.Tensor, int, int]]) -> None:
        """moetier_swiglu_bf16_layer: `weights` fp32 [P], items (gate_up_proj, down_proj, first row, end row), in
        as few calls as keep the work space within LAYER_SCRATCH_BYTES (a decode step's: one)."""
        h, i = items[0][1].shape
        rows_per_call = max(1, LAYER_SCRATCH_BYTES // (4 * (h + i)))
        group: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []
        lo = hi = 0  # the rows the group covers
        for gu, d, a, b in items:
            for start in range(a, b, rows_per_call):  # (an expert with a long prefill's tokens: in pieces)
                end = min(b, start + rows_per_call)
                if group and max(hi, end) - min(lo, start) > rows_per_call:
                    self._layer_call(ys, xs, weights, group)
                    group = []
                lo, hi = (start, end) if not group else (min(lo, start), max(hi, end))
                group.append((gu, d, start, end))
        if group:
            self._layer_call(ys, xs, weights, group)

    def _layer_call(self, ys: torch.Tensor, xs: torch.Tensor, weights: torch.Tensor,
                    items: list[tuple[torch.Tensor, torch.Tensor, int, int]]) -> None:
        """One call on the rows items cover, from the first item's first row (the work space only for them)."""
        n, (h, i) = len(items), items[0][1].shape
        base = min(a for *_, a, _ in items)
        p = max(b for *_, b in items) - base
        ptrs = np.array([[g.data_ptr() for g, *_ in items], [d.data_ptr() for _, d, *_ in items]],
                        dtype=np.int64)  # [2, n]: gate_up, down
        spans = np.array([r - base for *_, a, b in items for r in (a, b)], dtype=np.int64)  # [2n]
        self.lib.moetier_swiglu_bf16_layer(n, ptrs[0].ctypes.data, ptrs[1].ctypes.data, spans.ctypes.data, p,
                                           xs[base].data_ptr(), weights[base:].data_ptr(), ys[base].data_ptr(), h, i,
                                           self._scratch(p * (h + i)))

    def _swiglu_row(self, out: torch.Tensor, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                    weight: float) -> None:
        h, i = down_proj.shape
        self.lib.moetier_swiglu_bf16(gate_up_proj.data_ptr(), down_proj.data_ptr(), x.data_ptr(), weight,
                                     out.data_ptr(), h, i, self._scratch(h + i))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not x.is_contiguous():  # (row by row: a row's norm is its own alone)
            return rms_norm(x, weight, eps)
        n = x.shape[-1]
        y = torch.empty_like(x)
        self.lib.moetier_rms_norm_bf16(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
        return y

    def rms_norm_fp32_weight(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not (x.is_contiguous() and weight.dtype == torch.bfloat16 and weight.is_contiguous()):
            return rms_norm_fp32_weight(x, weight, eps)
        n = x.shape[-1]
        y = torch.empty_like(x)
        self.lib.moetier_rms_norm_fp32w_bf16(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
        return y

    def combine(self, x: torch.Tensor, token_of: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 1 or not ys.is_contiguous():  # (one token: every row is its own)
            return super().combine(x, token_of, ys)
        y = torch.empty_like(x)
        self.lib.moetier_sum_rows_bf16(ys.data_ptr(), ys.shape[0], ys.shape[1], y.data_ptr())
        return y

    def rope(self, rope: RopeTables, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        if x.shape[0] != 1 or not batch.decode or not x.is_contiguous() or not rope.plain(x.shape[-1]):
            return rope(x, batch.positions)
        position = batch.lengths_host[0] - 1  # the one token's, known on the host: no read of batch.positions
        _, heads, d = x.shape
        row = position * d * rope.cos.element_size()
        y = torch.empty_like(x)
        self.lib.moetier_rope_bf16(x.data_ptr(), rope.cos.data_ptr() + row, rope.sin.data_ptr() + row, y.data_ptr(),
                                   heads, d)
        return y

    def kv_write(self, kv: KVCache, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """One decode token's in one native call (its row and position known on the host): the same bytes."""
        keys, values = kv.k[layer], kv.v[layer]
        if (not batch.decode or k.shape[0] != 1 or k.dtype != keys.dtype or v.dtype != values.dtype
                or not (k.is_contiguous() and v.is_contiguous() and keys.is_contiguous() and values.is_contiguous())):
            return super().kv_write(kv, layer, batch, k, v)
        _, heads, max_len, d = keys.shape
        row = batch.rows_host[0] * heads * max_len * d * keys.element_size()
        self.lib.moetier_kv_write(k.data_ptr(), v.data_ptr(), keys.data_ptr() + row, values.data_ptr() + row, heads,
                                  max_len, d, keys.element_size(), batch.lengths_host[0] - 1)

    def decode_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: StepBatch,
                         window: int | None, scale: float) -> torch.Tensor:
        b = q.shape[0]
        if b > NATIVE_ROWS or not (q.is_contiguous() and keys.is_contiguous() and values.is_contiguous()):
            return super().decode_attention(q, keys, values, batch, window, scale)
        return self._decode_attention(q, keys, values, batch, window, scale, None)

    def sink_decode_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: StepBatch,
                              window: int | None, scale: float, sinks: torch.Tensor) -> torch.Tensor | None:
        b = q.shape[0]
        if (b > NATIVE_ROWS or sinks.dtype != torch.bfloat16 or not sinks.is_contiguous()
                or not (q.is_contiguous() and keys.is_contiguous() and values.is_contiguous())):
            return None
        return self._decode_attention(q, keys, values, batch, window, scale, sinks)

    def _decode_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: StepBatch,
                          window: int | None, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
        b = q.shape[0]
        _, hkv, s_max, d = keys.shape
        out = torch.empty_like(q)
        scratch = self._scratch(self.lib.moetier_threads() * (max(batch.lengths_host) + 2 * d))  # a part a thread
        q_row, row_bytes = q[0].numel() * q.element_size(), hkv * s_max * d * keys.element_size()
        for i in range(b):  # one call a sequence (its own cache row and length: each as it would be alone)
            end = batch.lengths_host[i]  # the query sits at end - 1 and sees (end - 1 - window, end - 1]
            start = max(0, end - window) if window else 0
            row = batch.rows_host[i] * row_bytes
            self.lib.moetier_decode_attention_sinks_bf16(
                q.data_ptr() + i * q_row, keys.data_ptr() + row, values.data_ptr() + row, out.data_ptr() + i * q_row,
                q.shape[1], hkv, start, end, s_max, d, scale, None if sinks is None else sinks.data_ptr(), scratch)
        return out


class NativeWithGemm(NativeKernels):
    """The native kernels for decode (up to NATIVE_ROWS rows: a step, a server's batch — each row as it would be
    alone), torch's bf16 GEMM for more (a prefill's products and its experts' many tokens), on CPUs whose bf16 dot
    products torch's GEMM (oneDNN) uses: AVX-512 BF16 or AMX. Why: on a Zen 4 a 256 x 2048 by 2048 x 4096 product
    ran at 427 GFLOP/s through torch against 174 through moetier_linear_bf16_rows (and 87 on its AVX2 path), where
    on an AVX2-only CPU torch's runs at ~18 and the native one at ~50 (NativeKernels alone). Both sum in fp32 and
    round once; only the order differs, as between the native kernels and torch everywhere."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] > NATIVE_ROWS:
            return F.linear(x, weight, bias)
        return super().linear(x, weight, bias)

    def swiglu(self, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > NATIVE_ROWS:
            return TorchKernels.swiglu(self, x, gate_up_proj, down_proj)
        return super().swiglu(x, gate_up_proj, down_proj)

    def expert(self, out: torch.Tensor, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
               weights: torch.Tensor) -> None:
        if x.shape[0] > NATIVE_ROWS:
            return TorchKernels.expert(self, out, x, gate_up_proj, down_proj, weights)
        super().expert(out, x, gate_up_proj, down_proj, weights)

    def expert_layer(self, ys: torch.Tensor, xs: torch.Tensor, weights: torch.Tensor,
                     items: list[tuple[torch.Tensor, torch.Tensor, int, int]]) -> None:
        few = [item for item in items if item[3] - item[2] <= NATIVE_ROWS]
        for gu, d, a, b in items:
            if b - a > NATIVE_ROWS:  # (a prefill's busy experts: one GEMM each)
                TorchKernels.expert(self, ys[a:b], xs[a:b], gu, d, weights[a:b])
        if few:
            super().expert_layer(ys, xs, weights, few)


def triton_installed() -> bool:
    """Whether triton imports here (the GPU machine's python has it; moetier does not depend on it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


GEMM_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo's: bf16 dot products torch's CPU GEMM uses


PATHS = {"avx2": ("avx2", False), "avx2-vnni": ("avx2-vnni", False), "avx512": ("avx512", False),
         "amx": ("avx512", True)}  # name -> (library, GEMM)


def make_kernels(name: str, dtype: torch.dtype, device: torch.device) -> TorchKernels:
    """`auto`: native where it applies (bf16 on a CPU with AVX2 and a C compiler), else torch — saying why once
    when bf16 on the CPU falls back. `native` insists and fails with the reason; `torch` never builds anything.
    A path by name (`avx2`, `avx2-vnni`, `avx512`, `amx`; PATHS) is that path or a refusal saying what the CPU lacks: so the AVX2
    path runs, and is measured, on a CPU that has more."""
    if name not in KERNELS:
        raise MoetierError(f"unknown kernels {name!r}", hint=f"one of {', '.join(KERNELS)}")
    applies = dtype == torch.bfloat16 and torch.device(device).type == "cpu"
    if name in ("auto", "torch") and torch.device(device).type == "cuda":
        if name == "auto" and triton_installed():
            return TritonKernels()
        return CudaKernels()
    if name == "torch" or (name == "auto" and not applies):
        return TorchKernels()
    if not applies:
        raise MoetierError(f"the native kernels are for bf16 weights on the CPU; this model is {dtype} on {device}",
                           hint="use kernels 'auto' or 'torch'")
    if name in PATHS:
        return kernel_path(name)
    loaded = native.load()
    if loaded.lib is not None:
        gemm = any(flag in native.cpu_flags() for flag in GEMM_FLAGS)
        return (NativeWithGemm if gemm else NativeKernels)(loaded.lib, loaded.isa)
    if name == "native":
        raise MoetierError(f"the native kernels are not available: {loaded.reason}", hint="use kernels 'torch'")
    warnings.warn(f"moetier: bf16 decoding on torch's kernels, slower than the native ones: {loaded.reason}",
                  stacklevel=2)
    return TorchKernels()


def check_kernel_path(name: str) -> None:
    """A named path this CPU can run, or the one-line refusal (before anything loads or builds)."""
    isa, gemm = PATHS[name]
    runnable = native.runnable_isas()
    if isa not in runnable:
        raise MoetierError(f"--kernels {name}: this CPU has no {isa.upper()} path (it runs "
                           f"{', '.join(runnable) or 'neither AVX2 nor AVX-512'})",
                           hint=f"use --kernels auto, torch, or one of: {', '.join(runnable_paths()) or 'none'}")
    if gemm and "amx_bf16" not in native.cpu_flags():
        raise MoetierError(f"--kernels {name}: this CPU has no AMX (amx_bf16)",
                           hint=f"use --kernels auto, torch, or one of: {', '.join(runnable_paths()) or 'none'}")


def kernel_path(name: str) -> TorchKernels:
    """One named path: its library (every product in it), or for `amx` the AVX-512 library's decode rows beside
    torch's bf16 GEMM, which oneDNN runs on AMX; refused where this CPU cannot run it."""
    check_kernel_path(name)
    isa, gemm = PATHS[name]
    loaded = native.load(isa)
    if loaded.lib is None:
        raise MoetierError(f"--kernels {name}: the native kernels are not available: {loaded.reason}",
                           hint="use kernels 'torch'")
    return (NativeWithGemm if gemm else NativeKernels)(loaded.lib, loaded.isa)


def runnable_paths() -> list[str]:
    """The named paths this CPU runs."""
    flags, isas = native.cpu_flags(), native.runnable_isas()
    return [name for name, (isa, gemm) in PATHS.items() if isa in isas and (not gemm or "amx_bf16" in flags)]
