"""SwiGLU experts whose matrices are in GGML's block formats (a store's q8_0/q6_k/q5_k/q4_k copies, and a GGUF's
experts read in place): gate and up, then down, each through `GgmlLinear` — the native integer kernels for up to
a few dozen tokens (all of them in one call, `GgmlLinear.swiglu`), the matrix dequantized for torch's matmul beyond,
or always without the native library. Which format each matrix is in follows from its shape
(moetier/quant/precisions.py: format_of), so the layers of one precision may differ (a Q4_K_M file's down_proj is
Q6_K in some). `GgmlClampedExpert`: gpt-oss's experts (their released GGUFs' MXFP4 blocks, read in place) the same
way, with their biases and clamped SwiGLU."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from moetier.model.expert_kernels import Items, OneByOne, TokenTable
from moetier.model.ggml_linear import GGML_BITS, GGML_CLAMPED_BITS, MAX_TOKENS, TYPE_IDS, GgmlLinear
from moetier.quant.ggml_blocks import dequantize
from moetier.quant.precisions import GGUF_BLOCKS, MIXES, format_of


class TorchGgml:
    """GgmlLinear's contract without the native library: dequantized, torch's matmul."""

    def __call__(self, x: torch.Tensor, w: torch.Tensor, fmt: str) -> torch.Tensor:
        return x.float() @ dequantize(w.reshape(w.shape[0], -1), fmt).T


class GgmlExpert(OneByOne):
    """`lib`: the native library (None: torch's ops). `dtype`: the activations', which the gate·up product and the
    output are rounded to, as a float expert's torch ops round them."""

    def __init__(self, precision: str, dtype: torch.dtype, lib=None) -> None:
        if precision not in GGUF_BLOCKS and precision not in MIXES:
            raise ValueError(f"not a GGML block precision: {precision!r}")
        self.precision, self.dtype = precision, dtype
        self.linear = GgmlLinear(lib) if lib is not None else TorchGgml()
        self.fused = lib is not None and dtype == torch.bfloat16  # the native call computes bf16 models' experts
        self._formats: dict[tuple, str] = {}  # (in_features, the view's shape past its rows) -> format
        self._token_scratch: dict[tuple[int, int, int], int] = {}  # (k, H, I) -> bytes token_routed needs

    def _format(self, k: int, w: torch.Tensor) -> str:
        key = (k, *w.shape[1:])
        fmt = self._formats.get(key)
        if fmt is None:
            fmt = self._formats[key] = format_of(k, tuple(w.shape[1:]))
        return fmt

    def __call__(self, out: torch.Tensor, x: torch.Tensor, w: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
        h, i = x.shape[1], w["gate_up_proj"].shape[0] // 2
        gu_fmt, d_fmt = self._format(h, w["gate_up_proj"]), self._format(i, w["down_proj"])
        if self.fused and out.is_contiguous() and self.linear.fuses(x, gu_fmt, d_fmt, i):  # the same ops, one call
            self.linear.swiglu(out, x, w["gate_up_proj"], gu_fmt, w["down_proj"], d_fmt, weights)
            return
        gate_up = self.linear(x, w["gate_up_proj"], gu_fmt).to(self.dtype)  # [n, 2I]
        gate, up = gate_up[:, :i], gate_up[:, i:]
        act = F.silu(gate) * up  # [n, I]
        y = self.linear(act, w["down_proj"], d_fmt)  # [n, H] fp32
        out.copy_(y.to(self.dtype) * weights[:, None].to(self.dtype))

    def layer(self, ys: torch.Tensor, xs: torch.Tensor, weights: torch.Tensor, items: Items) -> None:
        """The experts with a pass's worth of rows (a decode step of a batch, a short prompt) in one native call
        (moetier_gq_swiglu_layer: one parallel region, bit for bit what `__call__` computes for each); the others,
        and all of them where that call does not compute them, one by one."""
        if not self.fused or xs.dtype != torch.bfloat16 or not (xs.is_contiguous() and ys.is_contiguous()):
            return super().layer(ys, xs, weights, items)
        h = xs.shape[1]
        few, rest = [], []
        for item in items:
            w, a, b = item
            i = w["gate_up_proj"].shape[0] // 2
            gu_fmt, d_fmt = self._format(h, w["gate_up_proj"]), self._format(i, w["down_proj"])
            takes = 0 < b - a <= MAX_TOKENS and self.linear.takes(gu_fmt, h) and self.linear.takes(d_fmt, i)
            (few if takes else rest).append((item, gu_fmt, d_fmt))
        if len(few) < 2 or len({w["gate_up_proj"].shape[0] for (w, _, _), *_ in few}) > 1:  # (one width I a call)
            return super().layer(ys, xs, weights, items)
        for (w, a, b), *_ in rest:
            if b > a:
                self(ys[a:b], xs[a:b], w, weights[a:b])
        i = few[0][0][0]["gate_up_proj"].shape[0] // 2
        gu_types = np.array([TYPE_IDS[gu] for _, gu, _ in few], dtype=np.int32)
        d_types = np.array([TYPE_IDS[d] for *_, d in few], dtype=np.int32)
        gu_ptrs = np.array([w["gate_up_proj"].data_ptr() for (w, _, _), *_ in few], dtype=np.int64)
        d_ptrs = np.array([w["down_proj"].data_ptr() for (w, _, _), *_ in few], dtype=np.int64)
        spans = np.array([r for (_, a, b), *_ in few for r in (a, b)], dtype=np.int64)  # [2n]: each expert's rows
        lib = self.linear.lib
        need = lib.moetier_gq_layer_scratch(xs.shape[0], h, i)
        if self.linear.scratch.numel() < need:
            self.linear.scratch = torch.empty(need, dtype=torch.uint8)
        rw = weights.to(torch.bfloat16).contiguous()
        arrays = (gu_types.ctypes.data, gu_ptrs.ctypes.data, d_types.ctypes.data, d_ptrs.ctypes.data)
        tail = (spans.ctypes.data, xs.shape[0], xs.data_ptr(), rw.data_ptr(), ys.data_ptr(), h, i,
                self.linear.scratch.data_ptr())
        self._layer_call(len(few), arrays, [w for (w, _, _), *_ in few], tail)

    def _layer_call(self, n: int, arrays: tuple, ws: list[dict[str, torch.Tensor]], tail: tuple) -> None:
        """`layer`'s native call on its n experts `ws`: `arrays` their types and blocks, `tail` the rest."""
        self.linear.lib.moetier_gq_swiglu_layer(n, *arrays, *tail)

    def token_table(self, ws: list[dict[str, torch.Tensor]]) -> TokenTable | None:
        """A layer's resident experts (by id) for `token_routed`: each one's blocks and their formats, as a layer's
        views hold them (a Q4_K_M file's down_proj differs by layer, not within one), or None where the native call
        does not compute them (no library, not bf16, a format or width the kernels lack)."""
        if not self.fused:
            return None
        h, i = ws[0]["down_proj"].shape[0], ws[0]["gate_up_proj"].shape[0] // 2
        rows = []
        for w in ws:
            gu, d = self._format(h, w["gate_up_proj"]), self._format(i, w["down_proj"])
            if not (self.linear.takes(gu, h) and self.linear.takes(d, i)):
                return None
            rows.append([w["gate_up_proj"].data_ptr(), TYPE_IDS[gu], w["down_proj"].data_ptr(), TYPE_IDS[d]])
        return TokenTable(np.array(rows, dtype=np.int64), (h, i), GGML_BITS)

    def token_routed(self, out: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     table: TokenTable) -> None:
        """One token's experts straight from the router's [1, k] outputs (TokenTable.takes them) in one native call
        (moetier_gq_swiglu_token_routed): what `token` computes — each expert as `__call__` computes it, in
        ascending ids, summed as the kernels' combine sums — without a Python call an expert."""
        (h, i), k = table.shape, topk_ids.shape[1]
        self.linear.lib.moetier_gq_swiglu_token_routed(
            table.ptrs.ctypes.data, topk_ids.data_ptr(), topk_weights.data_ptr(),
            32 if topk_weights.dtype == torch.float32 else 16, k, h, i, x.data_ptr(), out.data_ptr(),
            self._token_scratch_for(k, h, i))

    def _token_scratch_for(self, k: int, h: int, i: int) -> int:
        """The address of scratch enough for a token call through k experts of [2I, H] and [H, I]."""
        linear = self.linear
        need = self._token_scratch.get((k, h, i))
        if need is None:  # (once per shape: not a foreign call a layer)
            need = self._token_scratch[(k, h, i)] = linear.lib.moetier_gq_token_scratch(k, h, i)
        if linear.scratch.numel() < need:
            linear.scratch = torch.empty(need, dtype=torch.uint8)
        return linear.scratch.data_ptr()


class GgmlClampedExpert(GgmlExpert):
    """gpt-oss's experts in GGML's blocks (its GGUFs' MXFP4, read in place with their fp32 biases): what
    ClampedSwigluExpert computes on the weights' values, each product through `GgmlLinear` (the integer kernels,
    llama.cpp's arithmetic) with its bias added to the fp32 output before the rounding to the activations' dtype
    that a float expert's F.linear makes. With the native library and bf16 activations a layer's experts (`layer`)
    and a token's (`token_routed`) are one call each (csrc/q_ggml.c gq_glu: the same roundings), where the biases
    are fp32 as a GGUF keeps them; one by one through torch's ops otherwise (`__call__`, the reference)."""

    def __init__(self, precision: str, dtype: torch.dtype, alpha: float, limit: float, lib=None) -> None:
        super().__init__(precision, dtype, lib)
        self.alpha, self.limit = alpha, limit

    def __call__(self, out: torch.Tensor, x: torch.Tensor, w: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
        h, i = x.shape[1], w["gate_up_proj"].shape[0] // 2
        gu_fmt, d_fmt = self._format(h, w["gate_up_proj"]), self._format(i, w["down_proj"])
        gate_up = (self.linear(x, w["gate_up_proj"], gu_fmt) + w["gate_up_proj.bias"].float()).to(self.dtype)
        gate = gate_up[:, :i].clamp(max=self.limit)  # [n, I]
        up = gate_up[:, i:].clamp(min=-self.limit, max=self.limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        y = self.linear(act, w["down_proj"], d_fmt) + w["down_proj.bias"].float()  # [n, H] fp32
        out.copy_(y.to(self.dtype) * weights[:, None].to(self.dtype))

    @staticmethod
    def _native_biases(ws: list[dict[str, torch.Tensor]]) -> bool:
        return all(w[name].dtype == torch.float32 and w[name].is_contiguous() for w in ws
                   for name in ("gate_up_proj.bias", "down_proj.bias"))

    def layer(self, ys: torch.Tensor, xs: torch.Tensor, weights: torch.Tensor, items: Items) -> None:
        if not self._native_biases([w for w, _, _ in items]):
            return OneByOne.layer(self, ys, xs, weights, items)
        super().layer(ys, xs, weights, items)

    def _layer_call(self, n: int, arrays: tuple, ws: list[dict[str, torch.Tensor]], tail: tuple) -> None:
        gu_bias = np.array([w["gate_up_proj.bias"].data_ptr() for w in ws], dtype=np.int64)
        d_bias = np.array([w["down_proj.bias"].data_ptr() for w in ws], dtype=np.int64)
        self.linear.lib.moetier_gq_glu_layer(n, *arrays, gu_bias.ctypes.data, d_bias.ctypes.data, self.alpha,
                                             self.limit, *tail)

    def token_table(self, ws: list[dict[str, torch.Tensor]]) -> TokenTable | None:
        """As GgmlExpert's, each row with the expert's biases' addresses after its blocks and types ([E, 6])."""
        table = super().token_table(ws)
        if table is None or not self._native_biases(ws):
            return None
        biases = [[w["gate_up_proj.bias"].data_ptr(), w["down_proj.bias"].data_ptr()] for w in ws]
        return TokenTable(np.concatenate([table.ptrs, np.array(biases, dtype=np.int64)], axis=1), table.shape,
                          GGML_CLAMPED_BITS)

    def token_routed(self, out: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     table: TokenTable) -> None:
        (h, i), k = table.shape, topk_ids.shape[1]
        self.linear.lib.moetier_gq_glu_token_routed(
            table.ptrs.ctypes.data, topk_ids.data_ptr(), topk_weights.data_ptr(),
            32 if topk_weights.dtype == torch.float32 else 16, k, h, i, self.alpha, self.limit, x.data_ptr(),
            out.data_ptr(), self._token_scratch_for(k, h, i))
