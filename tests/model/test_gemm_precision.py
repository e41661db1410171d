"""Which GEMM a prefill's dequantized products take: bf16 only where the CPU has bf16 dot products and oneDNN may
use them (moetier/model/gemm_precision.py)."""

from moetier.model.gemm_precision import bf16_gemm_is_fast

ZEN3 = frozenset({"avx", "avx2", "fma", "f16c"})
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_int8", "amx_tile"}


def test_bf16_where_the_cpu_has_bf16_dot_products():
    assert not bf16_gemm_is_fast(ZEN3, {}) and not bf16_gemm_is_fast(frozenset(), {})
    assert bf16_gemm_is_fast(ZEN4, {}) and bf16_gemm_is_fast(SAPPHIRE_RAPIDS, {})
    assert not bf16_gemm_is_fast(ZEN4 - {"avx512_bf16"}, {})  # (AVX-512 with VNNI alone: no bf16 dots)


def test_a_cap_on_onednn_below_bf16_counts_as_their_absence():
    assert not bf16_gemm_is_fast(ZEN4, {"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert not bf16_gemm_is_fast(ZEN4, {"DNNL_MAX_CPU_ISA": "avx512_core_vnni"})  # (the old name; any case)
    assert bf16_gemm_is_fast(SAPPHIRE_RAPIDS, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"})
    assert bf16_gemm_is_fast(ZEN4, {"ONEDNN_MAX_CPU_ISA": "ALL"})
