"""How a store lays out an expert's quantized copy in its blob (the codes' format: moetier/quant/codes.py)."""

from __future__ import annotations

from moetier.quant.codes import BITS, group_size
from moetier.store.format import PrecisionLayout


def expert_layout(precision: str, shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> PrecisionLayout:
    """How one expert's `precision` copy sits in a blob: per matrix its codes, then its scales (and zeros); then its
    biases as they are (`shapes`: ModelSpec.expert_shapes)."""
    if precision not in BITS:
        raise ValueError(f"unknown quantized precision {precision!r}; known: {', '.join(BITS)}")
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
