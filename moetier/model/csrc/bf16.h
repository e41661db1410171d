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
