"""Dense weights at a quantized precision (`--dense-precision int8|int4|q8_0|q4_k_m`, or a GGUF's own blocks), as
llama.cpp's Q4_K_M and Q8_0 files quantize attention and the head beside the experts: at batch 1 a decode step
reads every attention projection and the head once (0.74 GB of OLMoE-1B-7B's 2.35 GB a token in bf16), so with
int4 experts they are most of the bytes.

The matrices that only ever meet `kernels.linear` — each layer's q/k/v/o projections and the head — are quantized
when the engine loads (moetier/quant/codes.py's formats; the store is not changed), and `QuantizedDenseKernels`
computes them: up to 4 rows by integer dot products from the codes (csrc/q_int.c), more rows (a prefill) through
the matrix dequantized to bf16 once per call. GGML's formats (q8_0, q4_k_m, and a GGUF's attention and head read in
place) are `BlockMatrix`es, computed by csrc/q_ggml.c's integer kernels. Embeddings, norms, routers, shared experts
and dense MLPs stay as they are. Not exact by definition: `moetier eval --sweep dense-precision=int8,int4` measures
what it costs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetier.config import ModelSpec
from moetier.errors import MoetierError
from moetier.model.expert_kernels import TOKENS_A_CALL
from moetier.model.gemm_precision import bf16_gemm_is_fast, integer_tokens
from moetier.model.ggml_linear import GgmlLinear
from moetier.model.kernels import TorchKernels
from moetier.quant import kquants
from moetier.quant.codes import BITS, Quantized, dequantize, group_size, quantize, quantized_nbytes
from moetier.quant.ggml_blocks import FORMATS
from moetier.quant.ggml_blocks import dequantize as ggml_dequantize
from moetier.quant.precisions import matrix_format, use_more_bits

DENSE_PRECISIONS = ("native", "int8", "int4", "q8_0", "q4_k_m")
# GGML's, as llama.cpp's files keep them (computed as a GGUF's own: BlockMatrix): q8_0 everywhere; q4_k_m Q4_K with
# attn_v in Q6_K in use_more_bits' layers and the head in Q6_K (llama-quant.cpp's Q4_K_M); q8_0 where a row is not
# whole 256-blocks. Fitted by moetier/quant/kquants.py as the engine loads: ~0.3 us a weight (seconds for the demo
# models, minutes for OLMoE-1B-7B's 0.5 B dense weights: a C quantizer is the lever)
BLOCK_DENSE = ("q8_0", "q4_k_m")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class QuantizedMatrix:
    """A dense [N, K] weight kept as its quantized copy; `group`: inputs per scale (K for int8's one a row)."""

    q: Quantized
    shape: tuple[int, int]
    group: int

    def __post_init__(self) -> None:
        if self.shape[1] % self.group:
            raise ValueError(f"group {self.group} does not divide in_features {self.shape[1]}")

    @property
    def bits(self) -> int:
        return BITS[self.q.precision]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q.codes, self.q.scales, self.q.zeros)
                   if t is not None)


@dataclass(frozen=True)
class BlockMatrix:
    """A dense [N, K] weight kept in one of GGML's block formats, as a GGUF file holds it (store/gguf_store.py):
    `data` uint8 [N, row bytes] in `fmt`."""

    data: torch.Tensor
    fmt: str
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != (self.shape[0], FORMATS[self.fmt].row_bytes(
                self.shape[1])):
            raise ValueError(f"{self.fmt} [{self.shape}] weights are uint8 [N, row bytes], got {tuple(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def block_format(name: str, precision: str, num_layers: int) -> str:
    """The GGML format of dense matrix `name` at block precision `precision` (llama.cpp's rule, above)."""
    if precision == "q8_0":
        return "q8_0"
    if name == "lm_head":
        return "q6_k"
    layer = int(name.split(".")[1])
    return "q6_k" if name.endswith("v_proj") and use_more_bits(layer, num_layers) else "q4_k"


def quantize_block_matrix(w: torch.Tensor, fmt: str) -> BlockMatrix:
    n, k = w.shape
    fmt = matrix_format(fmt, k)  # (q8_0 where rows are not whole blocks of the format)
    return BlockMatrix(kquants.quantize(w.float(), fmt), fmt, (n, k))


def quantize_matrix(w: torch.Tensor, precision: str, name: str = "", num_layers: int = 0):
    """`w` at dense precision `precision`: a QuantizedMatrix of our codes, or a BlockMatrix in GGML's formats."""
    if precision in BLOCK_DENSE:
        return quantize_block_matrix(w, block_format(name, precision, num_layers))
    n, k = w.shape
    group = k if precision == "int8" else group_size(precision, k)
    return QuantizedMatrix(quantize(w, precision), (n, k), group)


def check_dense_precision(spec: ModelSpec, precision: str) -> None:
    """Refused before anything is loaded: an unknown precision, or a model whose attention is not grouped-query
    (MLA's latent projections and an encoder-decoder's cross-attention are not quantized)."""
    if precision not in DENSE_PRECISIONS:
        raise MoetierError(f"unknown dense precision {precision!r}", hint=f"one of {', '.join(DENSE_PRECISIONS)}")
    if precision != "native" and (spec.latent_attention is not None or spec.encoder_decoder is not None):
        raise MoetierError(f"--dense-precision {precision} quantizes grouped-query attention and the head; "
                           f"{spec.family}'s attention is not that", hint="use --dense-precision native")


def quantized_names(names: list[str]) -> list[str]:
    """The dense tensors a quantized precision replaces: each layer's attention projections."""
    return [n for n in names if n.startswith("layers.") and n.rsplit(".", 1)[-1] in PROJECTIONS]


def dense_load_bytes(tensors: dict[str, tuple[tuple[int, ...], int]], precision: str) -> int:
    """What quantizing the dense weights while loading holds beside those already kept, at its peak: the largest
    float tensor read, its copy and the fp32 temporaries of its pieces — bounded by twice its bytes (measured on
    OLMoE's 206 MB head: 357 MB above what was kept at int4, 261 MB at int8). 0 for "native" (mapped)."""
    if precision == "native":
        return 0
    converted = quantized_names(list(tensors)) + ["lm_head" if "lm_head" in tensors else "embed_tokens"]
    return 2 * max(tensors[n][1] for n in converted)


def quantized_dense_bytes(tensors: dict[str, tuple[tuple[int, ...], int]], precision: str,
                          blocks: dict[str, int] | None = None) -> int:
    """The dense weights' bytes at `precision` from each tensor's (shape, bytes) alone, before loading them (a tied
    head gets a quantized copy of its own beside the embedding). `blocks`: at "native", tensors kept otherwise than
    whole, with what is kept of them — those a GGUF's blocks stand for, with the blocks' bytes (their float copies
    are mapped and dropped), and a table read by row (engine/embedding_rows.py), with its rows'."""
    if precision == "native":
        blocks = blocks or {}
        return sum(nbytes for name, (_, nbytes) in tensors.items() if name not in blocks) + sum(blocks.values())
    quantized = set(quantized_names(list(tensors)))
    kept = sum(nbytes for n, (_, nbytes) in tensors.items() if n not in quantized and n != "lm_head")
    head = tensors.get("lm_head", tensors["embed_tokens"])[0]
    if precision in BLOCK_DENSE:  # (each at its widest format: Q6_K for q4_k_m's v, q8_0 where rows are narrow)
        bits = 8.5 if precision == "q8_0" else 6.5625
        return kept + int(sum(tensors[n][0][0] * tensors[n][0][1] for n in quantized) * bits / 8) \
            + int(head[0] * head[1] * bits / 8)
    return kept + sum(quantized_nbytes(precision, *tensors[n][0]) for n in quantized) \
        + quantized_nbytes(precision, *head)


def quantizing(precision: str, num_layers: int = 0):
    """What `Store.load_dense(convert)` keeps of each tensor as it reads it: a `precision` copy of each projection
    and of an untied head (None for "native"), so the float matrices are never all in memory beside their copies."""
    if precision == "native":
        return None

    def convert(name: str, t: torch.Tensor):
        return quantize_matrix(t, precision, name, num_layers) if name == "lm_head" or quantized_names([name]) else t

    return convert


def quantize_dense(dense: dict, spec: ModelSpec, precision: str) -> dict:
    """`dense` with its attention projections and head as `precision` copies (those `quantizing` made while
    loading are kept; a tied head gets its own, the embedding staying as it is). "native" returns `dense`."""
    check_dense_precision(spec, precision)
    if precision == "native":
        return dense
    out, made = dict(dense), (QuantizedMatrix, BlockMatrix)
    for name in quantized_names(list(dense)):
        if not isinstance(out[name], made):
            out[name] = quantize_matrix(dense[name], precision, name, spec.num_layers)
    head = out.get("lm_head", dense["embed_tokens"])
    out["lm_head"] = head if isinstance(head, made) else quantize_matrix(head, precision, "lm_head", spec.num_layers)
    return out


def dense_bytes(dense: dict) -> int:
    return sum(t.nbytes if isinstance(t, (QuantizedMatrix, BlockMatrix)) else t.numel() * t.element_size()
               for t in dense.values())


class QuantizedDenseKernels:
    """`base`'s kernels, with `linear` also taking a QuantizedMatrix weight."""

    def __init__(self, base: TorchKernels, bf16_gemm: bool | None = None) -> None:
        self.base, self.name = base, base.name
        self.lib = getattr(base, "lib", None)
        # the rest of the interface is the base's, bound once (no lookup through a fallback per call)
        self.swiglu, self.expert, self.expert_layer = base.swiglu, base.expert, base.expert_layer
        self.expert_token, self.combine = base.expert_token, base.combine
        self.rms_norm, self.add_rms_norm = base.rms_norm, base.add_rms_norm
        self.rms_norm_fp32_weight, self.add_rms_norm_fp32_weight = base.rms_norm_fp32_weight, \
            base.add_rms_norm_fp32_weight
        self.rope, self.decode_attention, self.kv_write = base.rope, base.decode_attention, base.kv_write
        self.sink_decode_attention = base.sink_decode_attention
        self.positions_on_device = base.positions_on_device
        self.scratch = torch.empty(0, dtype=torch.uint8)
        self.dense = torch.empty(0, dtype=torch.bfloat16)  # a prefill's dequantized matrix, reused across calls
        self.fits: dict[tuple[int, int, int], bool] = {}
        # the most rows a quantized matrix computes from its codes; more: dequantized for torch's bf16 GEMM
        # (moetier/model/gemm_precision.py: unbounded where the CPU lacks bf16 dot products; None: as this CPU is)
        self.bf16_gemm = bf16_gemm_is_fast() if bf16_gemm is None else bf16_gemm
        self.limits = {p: integer_tokens(p, self.bf16_gemm) for p in BITS}
        self.ggml = GgmlLinear(self.lib, self.bf16_gemm) if self.lib is not None else None

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, BlockMatrix):
            return self._blocks(x, weight, bias)
        if not isinstance(weight, QuantizedMatrix):
            return self.base.linear(x, weight, bias)
        if (self.lib is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous()
                and x.shape[0] <= self.limits[weight.q.precision] and self._fits(weight)):
            y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
            for a in range(0, x.shape[0], TOKENS_A_CALL):  # (a prompt's rows too, up to where the bf16 GEMM pays)
                self._integer_rows(x[a:a + TOKENS_A_CALL], weight, y[a:a + TOKENS_A_CALL])
            return y if bias is None else y + bias
        return F.linear(x, self._dequantized(weight, x.dtype), bias)

    def _integer_rows(self, x: torch.Tensor, weight: QuantizedMatrix, y: torch.Tensor) -> None:
        """y [rows, N] bf16 = x [rows, K] times the matrix, from its codes (csrc/q_int.c: each row of codes read
        once for all of x's rows)."""
        (n, k), rows, q = weight.shape, x.shape[0], weight.q
        need = self.lib.moetier_linear_qi_scratch(weight.bits, weight.group, n, k, rows)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need, dtype=torch.uint8)
        self.lib.moetier_linear_qi(weight.bits, q.codes.data_ptr(), q.scales.data_ptr(),
                                   None if q.zeros is None else q.zeros.data_ptr(), weight.group, x.data_ptr(),
                                   y.data_ptr(), n, k, rows, self.scratch.data_ptr())

    def _blocks(self, x: torch.Tensor, weight: BlockMatrix, bias: torch.Tensor | None) -> torch.Tensor:
        """A GGUF's matrix: the integer kernels for a few rows (fp32 out, rounded to x's dtype as a product in it
        is), its blocks dequantized for more."""
        if self.ggml is None:
            return F.linear(x, ggml_dequantize(weight.data, weight.fmt).to(x.dtype), bias)
        if x.dim() == 2 and self.ggml.passes(x, weight.fmt):  # a few rows (any, without bf16 dot products)
            y = self.ggml(x, weight.data, weight.fmt).to(x.dtype)
            return y if bias is None else y + bias
        return F.linear(x, self.ggml.dequantize(weight.data, weight.fmt, weight.shape[1], x.dtype), bias)

    def _fits(self, weight: QuantizedMatrix) -> bool:
        key = (weight.bits, weight.shape[1], weight.group)
        if key not in self.fits:  # (once per shape)
            self.fits[key] = bool(self.lib.moetier_qi_fits(*key))
        return self.fits[key]

    def _dequantized(self, weight: QuantizedMatrix, dtype: torch.dtype) -> torch.Tensor:
        if self.lib is None or dtype != torch.bfloat16:
            return dequantize(weight.q, dtype)
        n, k = weight.shape
        if self.dense.numel() < n * k:
            self.dense = torch.empty(n * k, dtype=torch.bfloat16)
        out = self.dense[:n * k].view(n, k)
        q = weight.q
        self.lib.moetier_dequant_q(weight.bits, q.codes.data_ptr(), q.scales.data_ptr(),
                                   None if q.zeros is None else q.zeros.data_ptr(), n, k, weight.group,
                                   out.data_ptr())
        return out


def with_dense_precision(kernels: TorchKernels, precision: str, dense: dict | None = None):
    """The kernels a model with `precision` dense weights computes on (native ones from a GGUF's blocks too)."""
    blocks = dense is not None and any(isinstance(t, BlockMatrix) for t in dense.values())
    return kernels if precision == "native" and not blocks else QuantizedDenseKernels(kernels)
