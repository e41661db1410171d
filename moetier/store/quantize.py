"""How a store lays out an expert's quantized copy in its blob (the codes' format: moetier/quant/codes.py; GGML's
block formats: moetier/quant/ggml_blocks.py)."""

from __future__ import annotations

from moetier.quant.codes import BITS, group_size
from moetier.quant.ggml_blocks import FORMATS
from moetier.quant.precisions import QUANTIZED, is_block, matrix_format
from moetier.store.format import PrecisionLayout


def expert_layout(precision: str, shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> PrecisionLayout:
    """How one expert's `precision` copy sits in a blob: per matrix its codes, then its scales (and zeros); then its
    biases as they are (`shapes`: ModelSpec.expert_shapes)."""
    if precision not in QUANTIZED:
        raise ValueError(f"unknown quantized precision {precision!r}; known: {', '.join(QUANTIZED)}")
    if is_block(precision):
        return _block_layout(precision, shapes)
    tensors = []
    for name, shape in shapes:
        if len(shape) == 1:
            tensors.append((name, "bfloat16", shape))
            continue
        n, k = shape
        if precision == "int8":
            tensors += [(name, "int8", (n, k)), (f"{name}.scales", "bfloat16", (n,))]
            continue
        per = 8 // BITS[precision]
        if k % per:
            raise ValueError(f"{precision} packs {per} inputs a byte; in_features {k} is not a multiple of {per}")
        groups = k // group_size(precision, k)
        tensors += [(name, "uint8", (n, k // per)), (f"{name}.scales", "bfloat16", (n, groups)),
                    (f"{name}.zeros", "bfloat16", (n, groups))]
    return PrecisionLayout.packed(precision, tensors)


def _block_layout(precision: str, shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> PrecisionLayout:
    """Each matrix as its rows of blocks (dtype: the block format's name, bytes [N, row bytes]), as a GGUF file
    holds an expert's slice of a stacked tensor; biases in bfloat16."""
    tensors = []
    for name, shape in shapes:
        if len(shape) == 1:
            tensors.append((name, "bfloat16", shape))
            continue
        n, k = shape
        fmt = matrix_format(precision, k)
        tensors.append((name, fmt, (n, FORMATS[fmt].row_bytes(k))))
    return PrecisionLayout.packed(precision, tensors)
