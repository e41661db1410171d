"""How a store lays out an expert's quantized copy in its blob (the codes' format: moetier/quant/codes.py; GGML's
block formats: moetier/quant/ggml_blocks.py)."""

from __future__ import annotations

from collections import Counter

from moetier.quant.codes import BITS, group_size
from moetier.quant.precisions import MIXES, QUANTIZED, is_block, matrix_format, matrix_shape, mix_format
from moetier.store.format import PrecisionLayout


def expert_layout(precision: str, shapes: tuple[tuple[str, tuple[int, ...]], ...],
                  moe_layers: tuple[int, ...] = ()) -> PrecisionLayout:
    """How one expert's `precision` copy sits in a blob: per matrix its codes, then its scales (and zeros); then its
    biases as they are (`shapes`: ModelSpec.expert_shapes). A mix's layout differs by layer (`moe_layers`)."""
    if precision not in QUANTIZED:
        raise ValueError(f"unknown quantized precision {precision!r}; known: {', '.join(QUANTIZED)}")
    if precision in MIXES:
        return _mix_layout(precision, shapes, moe_layers)
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


def _mix_layout(precision: str, shapes: tuple[tuple[str, tuple[int, ...]], ...],
                moe_layers: tuple[int, ...]) -> PrecisionLayout:
    """A mix's layout: its base format's, and where use_more_bits widens a layer's down_proj, that layer's own."""
    if not moe_layers:
        raise ValueError(f"{precision} is laid out per layer: give the model's MoE layers")
    n = len(moe_layers)
    per = {layer: _block_layout(precision, shapes, {name: mix_format(precision, name, i, n) for name, _ in shapes})
           .tensors for i, layer in enumerate(moe_layers)}
    common = Counter(per.values()).most_common(1)[0][0]
    return PrecisionLayout(precision, common, {layer: t for layer, t in per.items() if t != common})


def _block_layout(precision: str, shapes: tuple[tuple[str, tuple[int, ...]], ...],
                  formats: dict[str, str] | None = None) -> PrecisionLayout:
    """Each matrix as its rows of blocks (dtype: the block format's name, bytes as `matrix_shape` views them), as
    a GGUF file holds an expert's slice of a stacked tensor; biases (gpt-oss's) in float32, as a GGUF keeps them,
    so that the one native call of GgmlClampedExpert takes them. `formats`: each matrix's (a mix's layer)."""
    tensors = []
    for name, shape in shapes:
        if len(shape) == 1:
            tensors.append((name, "float32", shape))
            continue
        n, k = shape
        fmt = matrix_format(formats[name] if formats else precision, k)
        tensors.append((name, fmt, matrix_shape(fmt, n, k)))
    return PrecisionLayout.packed(precision, tensors)
