"""The quantized precisions a store's expert copies come in, in one place: moetier's own codes (codes.py: int8,
int4, int2) and GGML's block formats (ggml_blocks.py: q8_0, q6_k, q5_k, q4_k — the types llama.cpp's Q8_0, Q6_K,
Q5_K_M and Q4_K_M files hold, fitted as ggml fits them by kquants.py, so one set of kernels serves a GGUF's
experts and our own copies).

A block format needs whole blocks in a row (256 inputs for the k-quants, 32 for q8_0); a matrix whose rows are
not (a small model's 64-wide down_proj) takes q8_0 where its rows are whole blocks of 32. llama.cpp falls back to
q5_0/q5_1/q8_0 by type; we take q8_0 always — more precise, a format the kernels already have."""

from __future__ import annotations

from moetier.quant.formats import BITS, FORMATS

BLOCKS = ("q8_0", "q6_k", "q5_k", "q4_k")  # most precise first
# llama.cpp's mixes for our own copies: (the base format, the format `use_more_bits` layers' down_proj take) —
# Q4_K_M's rule (llama-quant.cpp) for an expert's matrices; the attention and head it also changes are
# --dense-precision's business, not an expert copy's
MIXES = {"q4_k_m": ("q4_k", "q6_k")}
LEGACY = ("q5_1", "q5_0", "q4_1", "q4_0")  # read from a GGUF, never made here: llama-quantize's fallbacks
# ...and each read from a GGUF alone, in blocks of 32 viewed [N, blocks, block bytes] (format_of): the legacy
# fallbacks and gpt-oss's MXFP4 (its released files' experts)
READ_ONLY = (*LEGACY, "mxfp4")
# ...of which moetier makes one as a copy too: MXFP4 (ggml's quantizer, kquants.py) — a gpt-oss checkpoint's values
# exactly, each block's codes again, where its store holds them dequantized
MADE_READ_ONLY = ("mxfp4",)
GGUF_BLOCKS = (*BLOCKS, *READ_ONLY)  # the formats a GGUF's matrices are computed in
CODES = tuple(BITS)  # int8, int4, int2


def use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's choice of the layers (of `n`) whose ffn_down a _M mix keeps wider: the first and last
    eighth, and every third between (OLMoE's 16: layers 0, 1, 4, 7, 10, 13, 14, 15 — what its Q4_K_M file holds)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def mix_format(precision: str, name: str, i: int, n: int) -> str:
    """The format of matrix `name` in layer `i` of `n` (counted among the MoE layers) of mix `precision`."""
    base, more = MIXES[precision]
    return more if name == "down_proj" and use_more_bits(i, n) else base


def bits_per_weight(precision: str) -> float:
    """Stored bits a weight (codes and scales) for a big matrix: what memory sizing reads (a mix: half its layers'
    down_proj wider, use_more_bits' share as layers grow)."""
    if precision in MIXES:
        base, more = (FORMATS[f].bits for f in MIXES[precision])
        return (2 * base + (base + more) / 2) / 3
    if precision in GGUF_BLOCKS:
        return FORMATS[precision].bits
    return {"int8": 8.0, "int4": 4.0 + 32 / 128, "int2": 2.0 + 32 / 64}[precision]


# every quantized copy, most precise first (low-tier takes the first that fits)
QUANTIZED = tuple(sorted((*CODES, *BLOCKS, *MADE_READ_ONLY, *MIXES), key=lambda p: -bits_per_weight(p)))


def is_block(precision: str) -> bool:
    """A copy in GGML's block formats: one format, or a mix of them."""
    return precision in BLOCKS or precision in MADE_READ_ONLY or precision in MIXES


def matrix_format(precision: str, k: int) -> str:
    """The block format of an [N, k] matrix's `precision` copy: the precision's own, or q8_0 where rows of `k` are
    not whole blocks of it; refused where they are not whole blocks of 32 either."""
    fmt = FORMATS[precision]
    if k % fmt.block_size == 0:
        return precision
    if k % FORMATS["q8_0"].block_size == 0:
        return "q8_0"
    either = "" if fmt.block_size == FORMATS["q8_0"].block_size else " (or of 32, in q8_0)"
    raise ValueError(f"{precision} needs in_features in whole blocks of {fmt.block_size}{either}; got {k}")


def format_of(k: int, shape: tuple[int, ...]) -> str:
    """The block format of a matrix of rows of `k` weights from its view's shape past the rows: (row bytes,) for
    q8_0 and the k-quants, whose bytes for the same weights differ (272, 210, 176, 144 for 256); (blocks, block
    bytes) for the legacy formats and mxfp4 (`matrix_shape`), two of which take as many bytes as a k-quant (q4_0
    and q4_k: 4.5 bits). So a GGUF's experts, whose down_proj is Q6_K in some layers and Q4_K or Q5_0 in others,
    are computed without being told."""
    if len(shape) == 2:
        fmt = next((FORMATS[n] for n in READ_ONLY if FORMATS[n].type_size == shape[1]), None)
        if fmt is not None and k == shape[0] * fmt.block_size:
            return fmt.name
    elif len(shape) == 1:
        for name in BLOCKS:
            fmt = FORMATS[name]
            if k % fmt.block_size == 0 and k // fmt.block_size * fmt.type_size == shape[0]:
                return name
    raise ValueError(f"no block format has rows of {k} weights as {shape}")


def matrix_shape(fmt: str, n: int, k: int) -> tuple[int, ...]:
    """How an [n, k] matrix in `fmt` is viewed: [n, row bytes], or [n, blocks, block bytes] for a legacy format
    or mxfp4 (format_of tells them apart by it)."""
    f = FORMATS[fmt]
    return (n, k // f.block_size, f.type_size) if fmt in READ_ONLY else (n, f.row_bytes(k))


def quantize_expert(tensors: dict, precision: str, formats: dict[str, str] | None = None) -> dict:
    """An expert's float tensors -> the named tensors of its `precision` blob (store/quantize.py lays them out):
    codes and scales for moetier's own precisions; for a block format each matrix's blocks as uint8 viewed as
    `matrix_shape` views them ([N, row bytes], mxfp4's [N, blocks, 17]; `formats`: each matrix's, as its layer's
    layout has them — a mix's differ by layer), its biases in float32 (store/quantize.py `_block_layout`)."""
    import torch

    from moetier.quant import codes, kquants

    if not is_block(precision):
        return codes.quantize_expert(tensors, precision)
    if formats is None and precision in MIXES:
        raise ValueError(f"{precision} is a mix: its formats come from the layer's layout")
    out = {}
    for name, t in tensors.items():
        if t.dim() == 1:
            out[name] = t.to(torch.float32)
            continue
        fmt = formats[name] if formats else matrix_format(precision, t.shape[1])
        out[name] = kquants.quantize(t.float(), fmt).view(matrix_shape(fmt, *t.shape))
    return out
