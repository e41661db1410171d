"""What each quantized format is, in sizes alone: moetier's own codes' bits and groups (codes.py computes them) and
GGML's block formats' weights and bytes a block (ggml_blocks.py computes them). precisions.py — the command line's
choices, memory sizing — reads them here, where no tensor library is imported, so refusing a typo loads no torch."""

from __future__ import annotations

from dataclasses import dataclass

GROUP_SIZE = {"int4": 128, "int2": 64}  # inputs sharing one (scale, zero) pair
BITS = {"int8": 8, "int4": 4, "int2": 2}

QK_K = 256  # weights in a k-quant super-block


@dataclass(frozen=True)
class BlockFormat:
    name: str  # GGUF's type name, lower case
    block_size: int  # weights a block holds
    type_size: int  # bytes a block takes

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.type_size <= 0:
            raise ValueError(f"{self.name}: block and type sizes must be positive")

    def row_bytes(self, k: int) -> int:
        """Bytes of a row of `k` weights."""
        if k % self.block_size:
            raise ValueError(f"{self.name} rows are whole blocks of {self.block_size}; got {k} weights")
        return k // self.block_size * self.type_size

    @property
    def bits(self) -> float:
        return 8 * self.type_size / self.block_size


FORMATS = {f.name: f for f in (
    BlockFormat("q8_0", 32, 2 + 32),  # fp16 d; int8 qs[32]
    BlockFormat("q4_k", QK_K, 2 + 2 + 12 + QK_K // 2),  # fp16 d, dmin; 6-bit scales and mins [12]; nibbles [128]
    BlockFormat("q5_k", QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),  # as q4_k, and the fifth bits qh[32]
    BlockFormat("q6_k", QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),  # ql[128], qh[64], int8 scales[16], fp16 d
    BlockFormat("mxfp4", 32, 1 + 16),  # E8M0 exponent; fp4 (E2M1) nibbles [16]
    # the legacy formats llama-quantize falls back to where a row is not whole 256-blocks (a Q4_K_M file's
    # 1,408-wide down_proj of Qwen1.5-MoE), and Q4_0 files: low nibbles the first 16 weights, high the next 16
    BlockFormat("q4_0", 32, 2 + 16),  # fp16 d; nibbles [16]: w = d·(q − 8)
    BlockFormat("q4_1", 32, 2 + 2 + 16),  # fp16 d, m; nibbles [16]: w = d·q + m
    BlockFormat("q5_0", 32, 2 + 4 + 16),  # fp16 d; fifth bits qh (32, little-endian); nibbles [16]: w = d·(q − 16)
    BlockFormat("q5_1", 32, 2 + 2 + 4 + 16),  # fp16 d, m; qh; nibbles: w = d·q + m
)}
