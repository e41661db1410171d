"""How one expert is computed from the tensors of its slot, per precision and activation: `kernel(out, x, w,
weights)` writes out [n, H] = expert(x [n, H]) * weights [n], `w` being the slot's named tensors;
`kernel.layer(ys, xs, weights, items)` several of a layer's experts, each (w, a, b) on rows a:b — in one native
call where the kernel has one (decode at batch 1: one parallel region a layer, not one an expert), else one by one;
`kernel.token(out, x, weights, ws, combine)` one token through several experts, their outputs summed (the integer
path: one native call, the row quantized once).

- `DenseExpert`: bf16/fp16/fp32 SwiGLU slots, through the engine's kernels (native rows or torch).
- `ClampedSwigluExpert` (gpt-oss) and `ReluExpert` (Switch): their own arithmetic, written as the reference's.
- `TritonExperts` (moetier/model/triton_experts.py): bf16 and int8/int4/int2 SwiGLU slots on a GPU (and GGML's
  blocks, gpt-oss's clamped SwiGLU with its biases), a layer's experts in two Triton launches from a table of their
  addresses (where triton is installed; else the torch path).
- `QuantizedExpert`: int8/int4/int2 slots (moetier/quant/codes.py's codes). With the native library and bf16
  activations: up to 4 tokens straight from the codes — by integer dot products against the activations quantized
  to int8 per block of 128 or 32 (`csrc/q_int.c`, llama.cpp's way: VNNI or AVX2) where the shapes tile its
  vectors, else unpacked to floats (`csrc/q_rows.c`); a row's codes are unpacked once for all the tokens —, more
  tokens by dequantizing the expert to bf16 once (in C) for the engine's bf16 matmul — measured per shape in
  bench/quant_kernels.py.
  Without it (fp32 models, `--kernels torch`, no compiler): dequantized with torch ops, correct and slow.

Chosen once per precision when the executor is made, never per call by a flag."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from moetier.config import ModelSpec
from moetier.errors import MoetierError
from moetier.model.gemm_precision import UNBOUNDED, bf16_gemm_is_fast, integer_tokens
from moetier.model.kernels import Fp32Buffer, TorchKernels, triton_installed
from moetier.quant.codes import BITS, Quantized, dequantize, matrix_names
from moetier.quant.precisions import GGUF_BLOCKS, MIXES

NATIVE_MAX_TOKENS = 4  # csrc/q_rows.c's MAX_TOKENS: tokens computed from the codes in one pass
TOKENS_A_CALL = 256  # the most tokens one call of csrc/q_int.c takes (it keeps theirs on the stack)


Items = list[tuple[dict[str, torch.Tensor], int, int]]  # (a slot's tensors, first row, end row) an expert


@dataclass(frozen=True)
class TokenTable:
    """A layer's resident experts as a kernel's one native `token` call takes them (moetier.engine.resident_layers):
    each expert's addresses, and the shapes the call needs. Made once; the slots must not move while it is used."""

    ptrs: np.ndarray  # [E, P] int64: expert e's P addresses
    shape: tuple[int, ...]  # (H, I) in bf16; (H, I, gate_up group, down group) quantized
    bits: int = 16  # the experts' precision: 16 (bf16 rows, P = 2), a quantized one's bits (P = 6), or -1: GGML
    # blocks and their types (P = 4: gate_up_proj's address and type, down_proj's; ggml_experts.py)
    device: torch.Tensor | None = None  # a GPU's table: `ptrs` there, P = 8 at every precision (triton_experts.py)
    like: dict[str, torch.Tensor] | None = None  # with `device`: one expert's tensors (the layout's strides)

    def __post_init__(self) -> None:
        if self.ptrs.ndim != 2 or self.ptrs.dtype != np.int64:
            raise ValueError(f"addresses must be [E, P] int64, got {self.ptrs.shape} {self.ptrs.dtype}")

    def takes(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> bool:
        """Whether `token_routed` takes these tokens: x [T, H] and the router's [T, k] outputs contiguous, the
        weights fp32 or bf16 (what the native call reads)."""
        return (x.is_contiguous() and topk_ids.is_contiguous() and topk_weights.is_contiguous()
                and topk_weights.dtype in (torch.float32, torch.bfloat16) and topk_ids.dtype == torch.int64)


class OneByOne:
    """`layer` as one call an expert; `token` as `layer` on copies of the row, then the kernels' combine."""

    routed_tokens = 1  # the most tokens one `token_routed` call takes (the native calls: one)

    def layer(self, ys: torch.Tensor, xs: torch.Tensor, weights: torch.Tensor, items: Items) -> None:
        for w, a, b in items:
            self(ys[a:b], xs[a:b], w, weights[a:b])

    def token(self, out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, ws: list[dict[str, torch.Tensor]],
              combine) -> None:
        """One token x [1, H] through a layer's experts `ws` (ascending ids) with its routing weights [n] (the
        router's dtype), their outputs summed into out [1, H] by `combine` (the kernels'): what grouping the pairs,
        `layer` and the combine compute for one token."""
        n = len(ws)
        xs = x.expand(n, x.shape[1]).contiguous()  # [n, H]
        ys = torch.empty_like(xs)
        self.layer(ys, xs, weights, [(w, e, e + 1) for e, w in enumerate(ws)])
        out.copy_(combine(x, torch.zeros(n, dtype=torch.long, device=x.device), ys))

    def token_table(self, ws: list[dict[str, torch.Tensor]]) -> TokenTable | None:
        """A layer's experts `ws` (by id) for `token_routed`, or None where `token` is the only way."""
        return None


class DenseExpert(OneByOne):
    def __init__(self, kernels: TorchKernels) -> None:
        self.kernels = kernels

    def __call__(self, out: torch.Tensor, x: torch.Tensor, w: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
        self.kernels.expert(out, x, w["gate_up_proj"], w["down_proj"], weights)

    def layer(self, ys: torch.Tensor, xs: torch.Tensor, weights: torch.Tensor, items: Items) -> None:
        self.kernels.expert_layer(ys, xs, weights, [(w["gate_up_proj"], w["down_proj"], a, b) for w, a, b in items])

    def token(self, out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, ws: list[dict[str, torch.Tensor]],
              combine) -> None:
        """Through the kernels' `expert_token` (their `combine` is the one passed: the executor's kernels')."""
        self.kernels.expert_token(out, x, weights, [(w["gate_up_proj"], w["down_proj"]) for w in ws])

    def token_table(self, ws: list[dict[str, torch.Tensor]]) -> TokenTable | None:
        lib, shape = getattr(self.kernels, "lib", None), ws[0]["down_proj"].shape  # [H, I]
        tensors = [w[name] for w in ws for name in ("gate_up_proj", "down_proj")]
        if (lib is None or any(w["down_proj"].shape != shape for w in ws)
                or not all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)):
            return None
        return TokenTable(np.array([[w["gate_up_proj"].data_ptr(), w["down_proj"].data_ptr()] for w in ws],
                                   dtype=np.int64), tuple(shape))

    def token_routed(self, out: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     table: TokenTable) -> None:
        """`token` for one token's experts straight from the router's topk_ids and topk_weights [1, k] (TokenTable.
        takes them) and the layer's `table`: the native call orders them by id and reads the weights as fp32 —
        what `token` computes, with no tensors to look through and nothing converted in Python (~110 us a layer at
        batch 1 with the caches cold)."""
        self.kernels.swiglu_token_routed(out, x, topk_ids, topk_weights, table.ptrs, table.shape[1])


class ClampedSwigluExpert(OneByOne):
    """gpt-oss: gate and up (with biases) clamped to ±limit (gate only from above), gate·sigmoid(alpha·gate)·(up + 1),
    then down with its bias. Gate and up are packed as halves of gate_up_proj (the checkpoint interleaves them;
    conversion splits them, so the same dot products run). Biases in another dtype than the weights (a GGUF's, read
    in place: its converter writes them in F32, exactly the checkpoint's bf16 values) are taken in the weights'."""

    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = alpha, limit

    def __call__(self, out: torch.Tensor, x: torch.Tensor, w: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
        gu_bias, d_bias = (w[name].to(w["down_proj"].dtype) for name in ("gate_up_proj.bias", "down_proj.bias"))
        gate, up = F.linear(x, w["gate_up_proj"], gu_bias).chunk(2, dim=-1)  # [n, I] each
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        out.copy_(F.linear(h, w["down_proj"], d_bias) * weights[:, None])


class ReluExpert(OneByOne):
    """Switch: down(relu(up(x))), no gate, no biases."""

    def __call__(self, out: torch.Tensor, x: torch.Tensor, w: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
        out.copy_(F.linear(F.relu(F.linear(x, w["up_proj"])), w["down_proj"]) * weights[:, None])


def dense_expert(kernels: TorchKernels, spec: ModelSpec | None = None):
    """The float kernel of the model's activation (SwiGLU when no spec is given)."""
    if spec is None or spec.activation == "swiglu":
        return DenseExpert(kernels)
    if spec.activation == "swiglu-clamped":
        return ClampedSwigluExpert(spec.swiglu_alpha, spec.swiglu_limit)
    return ReluExpert()


class QuantizedExpert(OneByOne):
    """`lib`: the native library (None: torch's ops). `dtype`: the activations' (and the dequantized weights').
    `dense`: the float kernel that computes the dequantized expert (None: SwiGLU through `kernels`); the native
    from-the-codes path is SwiGLU's alone."""

    def __init__(self, precision: str, kernels: TorchKernels, dtype: torch.dtype, lib=None, dense=None,
                 integer: bool = True, bf16_gemm: bool | None = None) -> None:
        if precision not in BITS:
            raise ValueError(f"not a quantized precision: {precision!r}")
        self.precision, self.bits, self.kernels, self.dtype = precision, BITS[precision], kernels, dtype
        self.lib = lib if dtype == torch.bfloat16 and dense is None else None
        self.integer = integer  # integer dot products where the shapes fit (False: always unpack to floats)
        # the most tokens computed from the codes; more: the dequantized matrices through torch's bf16 GEMM
        # (moetier/model/gemm_precision.py: unbounded where the CPU lacks bf16 dot products; None: as this CPU is)
        bf16_gemm = bf16_gemm_is_fast() if bf16_gemm is None else bf16_gemm
        self.integer_tokens = integer_tokens(precision, bf16_gemm)
        # ...and from codes unpacked to floats (csrc/q_rows.c, shapes q_int.c does not take): a pass's worth
        self.unpacked_tokens = NATIVE_MAX_TOKENS if bf16_gemm else UNBOUNDED
        self.dense_kernel = dense
        self.scratch = torch.empty(0, dtype=torch.float32)
        self.fits: dict[tuple[int, int, int, int], bool] = {}  # (h, i, group sizes) -> whether q_int.c covers them
        self.route_weights = Fp32Buffer()
        self.dense: dict[str, torch.Tensor] = {}  # dequantized matrices, reused across calls of the same shape

    def __call__(self, out: torch.Tensor, x: torch.Tensor, w: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
        n = x.shape[0]
        if self.lib is not None and n <= self._native_tokens(w, x.shape[1]) and x.is_contiguous() \
                and out.is_contiguous():
            for a in range(0, n, TOKENS_A_CALL):  # (a prompt's too, each row read once for a call's tokens)
                self._rows(out[a:a + TOKENS_A_CALL], x[a:a + TOKENS_A_CALL], w, weights[a:a + TOKENS_A_CALL])
            return
        if self.dense_kernel is not None:  # another activation: its float kernel on the dequantized matrices
            dense = {name: self._dequantized(name, w) for name in matrix_names(w)}
            biases = {name: t.to(self.dtype) for name, t in w.items() if name.endswith(".bias")}  # (kept in bf16)
            return self.dense_kernel(out, x, {**dense, **biases}, weights)
        self.kernels.expert(out, x, self._dequantized("gate_up_proj", w), self._dequantized("down_proj", w), weights)

    def _native_tokens(self, w: dict[str, torch.Tensor], h: int) -> int:
        """The most tokens this expert computes natively from its codes (more: its dequantized matrices' GEMM)."""
        return self.integer_tokens if self._fits(h, *_shape(w, h)) else self.unpacked_tokens

    def _rows(self, out: torch.Tensor, x: torch.Tensor, w: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
        n, h = x.shape
        i = w["gate_up_proj"].shape[0] // 2
        gu, dn = w["gate_up_proj.scales"], w["down_proj.scales"]
        gu_group, dn_group = _group(h, gu), _group(i, dn)
        rw = self.route_weights.of(weights)
        lib, args = self.lib, (
            self.bits, w["gate_up_proj"].data_ptr(), gu.data_ptr(), _ptr(w.get("gate_up_proj.zeros")), gu_group,
            w["down_proj"].data_ptr(), dn.data_ptr(), _ptr(w.get("down_proj.zeros")), dn_group, x.data_ptr(),
            rw.data_ptr(), out.data_ptr(), h, i, n)
        if self._fits(h, i, gu_group, dn_group):  # (any number of tokens)
            lib.moetier_swiglu_qi(*args, self._scratch(lib.moetier_swiglu_qi_scratch(self.bits, gu_group, dn_group,
                                                                                     h, i, n)))
            return
        scratch = self._scratch(4 * (max(h, i) + NATIVE_MAX_TOKENS * (2 * h + 3 * i)))
        for a in range(0, n, NATIVE_MAX_TOKENS):  # (csrc/q_rows.c: a pass's tokens a call)
            b = min(a + NATIVE_MAX_TOKENS, n)
            lib.moetier_swiglu_q(*args[:9], x[a:b].data_ptr(), rw[a:b].data_ptr(), out[a:b].data_ptr(), h, i, b - a,
                                 scratch)

    def layer(self, ys: torch.Tensor, xs: torch.Tensor, weights: torch.Tensor, items: Items) -> None:
        """The integer path's experts of a pass's rows in one call (`moetier_swiglu_qi_layer`, bit for bit what one
        call an expert computes), the others (a prompt's busier experts) one by one beside it; all one by one where
        that call does not compute them."""
        h = xs.shape[1]
        i, gu_group, dn_group = _shape(items[0][0], h)
        few = [item for item in items if 0 < item[2] - item[1] <= NATIVE_MAX_TOKENS]
        if (self.lib is None or len(few) < 2 or not (xs.is_contiguous() and ys.is_contiguous())
                or not self._fits(h, i, gu_group, dn_group)):
            return super().layer(ys, xs, weights, items)
        for w, a, b in items:
            if b - a > NATIVE_MAX_TOKENS:
                self(ys[a:b], xs[a:b], w, weights[a:b])
        items, n = few, len(few)
        ptrs = _pointers([w for w, *_ in items])  # [6, n]
        spans = np.array([r for _, a, b in items for r in (a, b)], dtype=np.int64)  # [2n]: each expert's rows
        p, row = ptrs.ctypes.data, ptrs.strides[0]
        rw = self.route_weights.of(weights)
        lib = self.lib
        lib.moetier_swiglu_qi_layer(self.bits, n, p, p + row, p + 2 * row, gu_group, p + 3 * row, p + 4 * row,
                                    p + 5 * row, dn_group, spans.ctypes.data, xs.shape[0], xs.data_ptr(), rw.data_ptr(),
                                    ys.data_ptr(), h, i, self._scratch(lib.moetier_swiglu_qi_layer_scratch(
                                        self.bits, gu_group, dn_group, h, i, xs.shape[0])))

    def token(self, out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, ws: list[dict[str, torch.Tensor]],
              combine) -> None:
        """The integer path in one call (`moetier_swiglu_qi_token`: the row quantized once for every expert, the
        outputs summed as the combine sums them, bit for bit what `layer` and the combine give); otherwise as
        OneByOne."""
        h = x.shape[1]
        i, gu_group, dn_group = _shape(ws[0], h)
        if (self.lib is None or not (x.is_contiguous() and out.is_contiguous())
                or not self._fits(h, i, gu_group, dn_group)):
            return super().token(out, x, weights, ws, combine)
        self._token_call(out, x, self.route_weights.of(weights).data_ptr(), _pointers(ws), (h, i, gu_group, dn_group))

    def token_table(self, ws: list[dict[str, torch.Tensor]]) -> TokenTable | None:
        h = ws[0]["down_proj.scales"].shape[0]  # (down's rows: the hidden size)
        shape = _shape(ws[0], h)
        if self.lib is None or not self._fits(h, *shape) or any(_shape(w, h) != shape for w in ws):
            return None
        return TokenTable(np.ascontiguousarray(_pointers(ws).T), (h, *shape), self.bits)

    def token_routed(self, out: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     table: TokenTable) -> None:
        """`token`'s integer path for one token's experts straight from the router's [1, k] outputs (TokenTable.
        takes them) and the layer's `table`: `moetier_swiglu_qi_token_routed`, nothing converted in Python."""
        (h, i, gu_group, dn_group), k, lib = table.shape, topk_ids.shape[1], self.lib
        lib.moetier_swiglu_qi_token_routed(
            self.bits, table.ptrs.ctypes.data, topk_ids.data_ptr(), topk_weights.data_ptr(),
            32 if topk_weights.dtype == torch.float32 else 16, k, gu_group, dn_group, x.data_ptr(), out.data_ptr(), h,
            i, self._scratch(lib.moetier_swiglu_qi_token_scratch(self.bits, gu_group, dn_group, h, i, k)))

    def _token_call(self, out: torch.Tensor, x: torch.Tensor, weights: int, ptrs: np.ndarray,
                    shape: tuple[int, int, int, int]) -> None:
        """moetier_swiglu_qi_token: `weights` the address of n fp32 routing weights; ptrs [6, n] contiguous (each
        expert's codes, scales, zeros of both matrices); shape (H, I, gate_up group, down group)."""
        (h, i, gu_group, dn_group), n = shape, ptrs.shape[1]
        p, row, lib = ptrs.ctypes.data, ptrs.strides[0], self.lib
        lib.moetier_swiglu_qi_token(self.bits, n, p, p + row, p + 2 * row, gu_group, p + 3 * row, p + 4 * row,
                                    p + 5 * row, dn_group, x.data_ptr(), weights, out.data_ptr(), h, i,
                                    self._scratch(lib.moetier_swiglu_qi_token_scratch(self.bits, gu_group, dn_group,
                                                                                      h, i, n)))

    def _fits(self, h: int, i: int, gu_group: int, dn_group: int) -> bool:
        key = (h, i, gu_group, dn_group)
        if key not in self.fits:  # (once per shape: not a C call per expert)
            self.fits[key] = self.integer and bool(self.lib.moetier_qi_fits(self.bits, h, gu_group)
                                                   and self.lib.moetier_qi_fits(self.bits, i, dn_group))
        return self.fits[key]

    def _scratch(self, nbytes: int) -> int:
        if self.scratch.numel() * 4 < nbytes:
            self.scratch = torch.empty((nbytes + 3) // 4, dtype=torch.float32)
        return self.scratch.data_ptr()

    def _dequantized(self, name: str, w: dict[str, torch.Tensor]) -> torch.Tensor:
        scales = w[f"{name}.scales"]
        n = scales.shape[0]
        k = w[name].shape[1] * 8 // self.bits
        if self.lib is None:
            return dequantize(Quantized(self.precision, w[name], scales, w.get(f"{name}.zeros")), self.dtype)
        buf = self.dense.get(name)
        if buf is None or buf.shape != (n, k):
            buf = self.dense[name] = torch.empty(n, k, dtype=torch.bfloat16)
        self.lib.moetier_dequant_q(self.bits, w[name].data_ptr(), scales.data_ptr(), _ptr(w.get(f"{name}.zeros")),
                                   n, k, _group(k, scales), buf.data_ptr())
        return buf


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


MATRIX_TENSORS = ("gate_up_proj", "gate_up_proj.scales", "gate_up_proj.zeros", "down_proj", "down_proj.scales",
                  "down_proj.zeros")


def _pointers(ws: list[dict[str, torch.Tensor]]) -> np.ndarray:
    """[6, n] int64: each expert's codes, scales and zeros (0: none, as int8's zeros) of both matrices."""
    return np.array([[_ptr(w.get(name)) or 0 for w in ws] for name in MATRIX_TENSORS], dtype=np.int64)


def _shape(w: dict[str, torch.Tensor], h: int) -> tuple[int, int, int]:
    """A quantized expert's intermediate size and its two matrices' group sizes (inputs per scale)."""
    i = w["gate_up_proj"].shape[0] // 2
    return i, _group(h, w["gate_up_proj.scales"]), _group(i, w["down_proj.scales"])


def _group(k: int, scales: torch.Tensor) -> int:
    """Inputs per scale: the whole row for int8's one scale per row."""
    return k if scales.dim() == 1 else k // scales.shape[1]


def make_expert_kernel(precision: str, kernels: TorchKernels, dtype: torch.dtype, spec: ModelSpec | None = None):
    """The kernel for slots of `precision` in a model computing in `dtype` (`spec`: the model, for its activation;
    None: SwiGLU)."""
    if precision in GGUF_BLOCKS or precision in MIXES:  # GGML's formats: SwiGLU experts (a GGUF's, our copies)
        from moetier.model.ggml_experts import GgmlClampedExpert, GgmlExpert

        lib = getattr(kernels, "lib", None) if kernels.name != "cuda" else None
        if spec is not None and spec.activation == "swiglu-clamped":  # gpt-oss's GGUF experts, read in place
            kernel = GgmlClampedExpert(precision, dtype, spec.swiglu_alpha, spec.swiglu_limit, lib)
            return _on_triton(0, kernel, kernels, dtype, spec)
        if spec is not None and spec.activation != "swiglu":
            raise MoetierError(f"{precision} copies are computed for SwiGLU experts; this model's are "
                               f"{spec.activation}", hint="use --precision int8, int4 or int2")
        return _on_triton(0, GgmlExpert(precision, dtype, lib), kernels, dtype)
    swiglu = spec is None or spec.activation == "swiglu"
    gated = swiglu or spec.activation == "swiglu-clamped"  # (the Triton kernels' activations: not Switch's ReLU)
    if precision not in BITS:
        kernel = dense_expert(kernels, spec)
        return _on_triton(16, kernel, kernels, dtype, spec) if gated and precision == "bf16" else kernel
    kernel = QuantizedExpert(precision, kernels, dtype, getattr(kernels, "lib", None),
                             None if swiglu else dense_expert(kernels, spec))
    return _on_triton(BITS[precision], kernel, kernels, dtype, spec) if gated else kernel


def _on_triton(bits: int, kernel, kernels: TorchKernels, dtype: torch.dtype, spec: ModelSpec | None = None):
    """On a GPU whose kernels take Triton (CudaKernels, `--kernels auto`) with bf16 activations: a layer's experts
    in two Triton launches (triton_experts.py; `bits` 0: GGML's block formats; a clamped SwiGLU `spec`'s with its
    biases), `kernel` (torch's ops) beneath for what they do not take; elsewhere `kernel` itself."""
    if not getattr(kernels, "triton", False) or dtype != torch.bfloat16:
        return kernel
    from moetier.model import triton_experts

    if not triton_installed():
        return kernel
    clamp = (triton_experts.Clamp(spec.swiglu_alpha, spec.swiglu_limit)
             if spec is not None and spec.activation == "swiglu-clamped" else None)
    if bits == 0:
        return triton_experts.TritonGgmlExperts(kernel, clamp=clamp)
    return triton_experts.TritonExperts(bits, kernel, clamp=clamp)
