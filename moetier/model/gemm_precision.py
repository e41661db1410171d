"""Whether torch's bf16 GEMM is fast on this CPU, for a prefill's products of quantized weights (their values are
approximations already, so the arithmetic is free to choose).

Where the CPU has bf16 dot products (AVX-512 BF16, AMX) oneDNN's bf16 GEMM of the dequantized matrix is the fastest
(Zen 4, 2 threads, a 2048 × 2048 matrix at 64 tokens: 366 GFLOP/s); without them it converts as it goes and runs at
44–47 GFLOP/s (the same machine with oneDNN held to AVX2 — what a Zen 3 or an Intel laptop has), where moetier's
integer block kernels run at ~170 and MKL's fp32 GEMM packs the matrix for every call. There GgmlLinear, the dense
layers' quantized linear and QuantizedExpert take the integer kernels for any number of tokens, each row read once for
all of them. Where it is fast they still take them up to a few dozen tokens (`integer_tokens`): a GEMM first pays
for dequantizing the whole matrix, which the integer kernels never do — a short prompt's experts, or a long one's
rarely chosen ones. A cap the user put on oneDNN (ONEDNN_MAX_CPU_ISA, or its old name DNNL_MAX_CPU_ISA) below
AVX512_CORE_BF16 counts as the CPU lacking them."""

from __future__ import annotations

import os

from moetier.model import native

BF16_DOT_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo's names
ONEDNN_CAPS_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                                      "AVX512_CORE_VNNI"})  # oneDNN's ISA names below AVX512_CORE_BF16


# Beside a fast bf16 GEMM, the most tokens a matrix in each format computes through the integer kernels (more: the
# matrix dequantized to bf16 for torch's GEMM): below where the two cross on a Zen 4 (AVX-512 BF16, 2 threads, an
# OLMoE-shaped expert — 2048 wide, 1024 inside — from memory, both ways in turn; docs/performance.md "Short prompts"),
# the integer kernels 1.1-1.2x the GEMM's speed at the limit and 2-3x at 5 tokens. The cross: int4, int8 and Q4_K·Q6_K
# ~32 tokens (nearer 64 in a slower stretch of the VM's memory), Q8_0 ~14, the legacy Q4_0/Q5_0/Q5_1 (1,408-wide rows)
# 20-28, MXFP4 (a gpt-oss-20b gate_up, 5,760 x 2,880, eight blocks at a time: 1.9 against 4.2 ms at 16 tokens, 7.8
# against 8.7 at 64, level at ~90). A CPU with AMX multiplies faster but dequantizes no faster, which is what the GEMM
# pays for below the cross.
INTEGER_TOKENS = {"q4_k": 24, "q5_k": 24, "q6_k": 24, "q8_0": 12, "q4_0": 16, "q4_1": 16, "q5_0": 16, "q5_1": 16,
                  "mxfp4": 64, "int8": 24, "int4": 24, "int2": 24}
INTEGER_TOKENS_DEFAULT = 16
UNBOUNDED = 1 << 62  # (no prompt is longer)


def integer_tokens(fmt: str, bf16_gemm: bool) -> int:
    """The most tokens a matrix (an expert's two) in `fmt` computes through the integer kernels: unbounded where
    torch's bf16 GEMM is slow (`bf16_gemm` False), else up to where dequantizing it for that GEMM pays."""
    return INTEGER_TOKENS.get(fmt, INTEGER_TOKENS_DEFAULT) if bf16_gemm else UNBOUNDED


def bf16_gemm_is_fast(flags: frozenset[str] | None = None, env: dict[str, str] | None = None) -> bool:
    """Whether torch's bf16 GEMM is fast here: the CPU has bf16 dot products and oneDNN may use them."""
    flags = native.cpu_flags() if flags is None else flags
    env = os.environ if env is None else env
    cap = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").upper()
    return bool(flags & BF16_DOT_FLAGS) and cap not in ONEDNN_CAPS_WITHOUT_BF16
