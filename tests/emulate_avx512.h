/* Force-included (gcc -include) into every source of the "avx512" (and "avx2-vnni") library that
   tests/emulate_avx512.py builds for a CPU without those instructions: the sources' branches for them (the macros
   they test defined at the end) with every 512-bit and VNNI/BF16 intrinsic they call emulated by SIMDe on AVX2 — the
   same operations, so the same integer sums and, for floats, the same roundings lane by lane; slow, and for
   correctness only. */
#ifndef MOETIER_EMULATE_AVX512_H
#define MOETIER_EMULATE_AVX512_H
#include <immintrin.h> /* the compiler's own first, AVX2's intrinsics native (a source's include of it is then none) */
#define SIMDE_ENABLE_NATIVE_ALIASES /* _mm512_add_ps and the rest name SIMDe's */
#define SIMDE_X86_AVX512F_NO_NATIVE
#define SIMDE_X86_AVX512BW_NO_NATIVE
#define SIMDE_X86_AVX512VL_NO_NATIVE
#define SIMDE_X86_AVX512DQ_NO_NATIVE
#define SIMDE_X86_AVX512CD_NO_NATIVE
#define SIMDE_X86_AVX512VNNI_NO_NATIVE
#define SIMDE_X86_AVX512BF16_NO_NATIVE
#include <simde/x86/avx512.h>
/* SIMDe 0.8.2 has no _mm512_reduce_add_ps: GCC's, its order of additions (the 256-bit halves, their 128-bit halves,
   then the pairs), so a sum comes out as a real AVX-512 CPU's build computes it. */
static inline float moetier_emulated_reduce_add_ps(simde__m512 v) {
    float a[16], half[8], quarter[4];
    simde_mm512_storeu_ps(a, v);
    for (int i = 0; i < 8; i++) half[i] = a[8 + i] + a[i];
    for (int i = 0; i < 4; i++) quarter[i] = half[4 + i] + half[i];
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}
#define _mm512_reduce_add_ps(v) moetier_emulated_reduce_add_ps(v)
/* What the sources' branches test for, said only now: the compiler's headers above were read without them (with them
   they take the instructions as enabled, and do not compile). MOETIER_EMULATE_AVXVNNI: the avx2-vnni library's
   branches instead — AVX-VNNI's VEX-encoded 256-bit dot products, the same operations as AVX-512 VL's */
#ifdef MOETIER_EMULATE_AVXVNNI
#define _mm256_dpbusd_avx_epi32(acc, u, x) simde_mm256_dpbusd_epi32(acc, u, x)
#define _mm256_dpwssd_avx_epi32(acc, a, b) simde_mm256_dpwssd_epi32(acc, a, b)
#define __AVXVNNI__ 1
#else
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#define __AVX512VNNI__ 1
#define __AVX512BF16__ 1
#endif
#endif
