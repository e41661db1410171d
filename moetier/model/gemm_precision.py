"""Whether torch's bf16 GEMM is fast on this CPU, for a prefill's products of quantized weights (their values are
approximations already, so the arithmetic is free to choose).

Where the CPU has bf16 dot products (AVX-512 BF16, AMX) oneDNN's bf16 GEMM of the dequantized matrix is the fastest
(Zen 4, 2 threads, a 2048 × 2048 matrix at 64 tokens: 366 GFLOP/s); without them it converts as it goes and runs at
44–47 GFLOP/s (the same machine with oneDNN held to AVX2 — what a Zen 3 or an Intel laptop has), where moetier's
integer block kernels run at ~170 and MKL's fp32 GEMM packs the matrix for every call. There GgmlLinear, the dense
layers' quantized linear and QuantizedExpert take the integer kernels for any number of tokens, a pass at a time. A cap the user put on oneDNN (ONEDNN_MAX_CPU_ISA, or its old name
DNNL_MAX_CPU_ISA) below AVX512_CORE_BF16 counts as the CPU lacking them."""

from __future__ import annotations

import os

from moetier.model import native

BF16_DOT_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo's names
ONEDNN_CAPS_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                                      "AVX512_CORE_VNNI"})  # oneDNN's ISA names below AVX512_CORE_BF16


def bf16_gemm_is_fast(flags: frozenset[str] | None = None, env: dict[str, str] | None = None) -> bool:
    """Whether torch's bf16 GEMM is fast here: the CPU has bf16 dot products and oneDNN may use them."""
    flags = native.cpu_flags() if flags is None else flags
    env = os.environ if env is None else env
    cap = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").upper()
    return bool(flags & BF16_DOT_FLAGS) and cap not in ONEDNN_CAPS_WITHOUT_BF16
