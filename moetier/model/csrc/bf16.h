/* Scalar bf16 <-> fp32 and an eight-lane horizontal sum, shared by the native kernels. */

#ifndef MOETIER_BF16_H
#define MOETIER_BF16_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet: as c10::BFloat16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* A function whose products and sums round one at a time as the C says (no fused multiply-add: gcc contracts
   otherwise), where a result must be bit for bit a reference's. */
#define NO_FMA __attribute__((optimize("fp-contract=off")))

/* Eight fp32 values rounded to bf16 as f32_to_bf16 rounds each (nearest even, a NaN quiet), each in its 32-bit lane.
   NO_FMA as its callers are, so it inlines into them (gcc keeps a function of other options apart). */
static inline NO_FMA __m256i bf16x8_lanes(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}

/* ...sixteen, packed: a's eight then b's, in one register. */
static inline NO_FMA __m256i bf16x16_of(__m256 a, __m256 b) {
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16x8_lanes(a), bf16x8_lanes(b)), 0xD8);
}

/* One hidden unit of a SwiGLU expert as the reference's bf16 ops round it: bf16(bf16(silu(g)) * u), g and u already
   rounded to bf16 (every kernel that makes h: one expression, so they cannot drift apart). */
static inline float swiglu_bf16(float g, float u) { return round_bf16(round_bf16(g / (1.0f + expf(-g))) * u); }

static inline void add_bf16(uint16_t *h, const uint16_t *d, long n) { /* torch's bf16 h + d: in fp32, rounded once */
    for (long i = 0; i < n; i++) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(d[i]));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Column k of n rows [n, H] summed row after row in fp32: the order the combine (moetier_sum_rows_bf16) sums a
   token's expert outputs in, for the kernels that sum them where they are made. */
static inline float sum_column(const float *ys, long n, long H, long k) {
    float acc = 0.0f;
    for (long e = 0; e < n; e++) acc += ys[e * H + k];
    return acc;
}

#endif
