/* Quantized experts (moetier/quant/codes.py's plain codes) on AVX2 CPUs, without repacking them at load.

   Why native: torch's CPU int4 matmul wants its own packing, which costs 19-27 ms per 2048x1408 expert to make —
   longer than reading the expert — and has no int2 at all; dequantizing with torch ops costs ~20 ms for int2.
   Here the codes are unpacked in registers next to the FMAs that use them, so a read expert is computed from
   straight away, and a quarter of bf16's bytes cross the memory bus for int4.

   Layout (per matrix [N, K]): int8 codes [N, K] with one scale per row, w = q * s; int4 and int2 codes packed
   [N, K * bits / 8] (input 8/bits*j + i in bits i*bits.. of byte j) with a scale and a zero per group of G
   inputs, w = (q - mid) * s + z, mid = 2^(bits-1).

   Arithmetic: the activation in fp32; each group's sum of q * x in fp32, then y = sum over groups of
   s * sum(q x) + (z - mid s) * sum(x), so the weights are never rounded (the reference, dequantize() in
   quantize.py, rounds them to bf16 first: results agree to bf16's precision, not bit for bit). Outputs are
   rounded to bf16 where torch's ops would round them (see bf16_rows.c's SwiGLU).

   Tokens: a row's codes are unpacked once for up to MAX_TOKENS tokens (a batch, or a prompt's tokens routed to
   this expert); larger counts are dequantized to bf16 once (`moetier_dequant_q`) for torch's matmul. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_TOKENS 4
#define PARALLEL_MIN_BYTES (128 * 1024)

/* A matrix's codes and scales, and the shape of its groups. int8 is the grouped form with one group per row,
   mid 0 and no zeros: w = q * s. */
typedef struct {
    int bits;
    const uint8_t *codes; /* int8: read as signed */
    const uint16_t *scales, *zeros; /* bf16; zeros NULL for int8 */
    long N, K, group;     /* int8: group = K */
} qmat;

/* Sixteen codes starting at input k of a row, in input order, as bytes: a nibble or crumb unpacked and the
   pieces interleaved back into input order (so activations stay in their natural order). */
static inline __m128i codes16(const uint8_t *q, long k, int bits) {
    if (bits == 8) return _mm_loadu_si128((const __m128i *)(q + k));
    if (bits == 4) {
        __m128i b = _mm_loadl_epi64((const __m128i *)(q + k / 2)), m = _mm_set1_epi8(15);
        return _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
    }
    __m128i b = _mm_cvtsi32_si128(*(const int32_t *)(q + k / 4)), m = _mm_set1_epi8(3);
    __m128i c0 = _mm_and_si128(b, m), c1 = _mm_and_si128(_mm_srli_epi16(b, 2), m);
    __m128i c2 = _mm_and_si128(_mm_srli_epi16(b, 4), m), c3 = _mm_and_si128(_mm_srli_epi16(b, 6), m);
    return _mm_unpacklo_epi16(_mm_unpacklo_epi8(c0, c1), _mm_unpacklo_epi8(c2, c3));
}

/* The sixteen codes as two vectors of eight floats. */
static inline void widen(__m128i c, int bits, __m256 *lo, __m256 *hi) {
    if (bits == 8) {
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
    } else {
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c, 8)));
    }
}

static inline float code_at(const qmat *m, const uint8_t *q, long k) {
    if (m->bits == 8) return (float)(int8_t)q[k];
    long per = 8 / m->bits;
    return (float)((q[k / per] >> ((k % per) * m->bits)) & ((1 << m->bits) - 1));
}

/* y[t] = row r of m . x_t for T tokens (a constant where this is inlined, so the per-token accumulators live in
   registers). Each group's sum of q x is kept as vectors and folded in with its scale (no horizontal sum per
   group); two accumulators per token hide the FMA latency. xsum[t][g]: x_t's sum over group g. */
static inline __attribute__((always_inline)) void row_t(const qmat *m, long r, const float *const *x,
                                                        const float *const *xsum, float *y, const int T,
                                                        const int bits) {
    long per = 8 / bits, groups = m->K / m->group, vec = m->group & ~15L;
    const uint8_t *q = m->codes + r * (m->K / per);
    float mid = bits == 8 ? 0.0f : (float)(1 << (bits - 1)), offset[MAX_TOKENS] = {0};
    __m256 total[MAX_TOKENS];
    for (int t = 0; t < T; t++) total[t] = _mm256_setzero_ps();
    for (long g = 0; g < groups; g++) {
        long k0 = g * m->group;
        __m256 a[MAX_TOKENS], b[MAX_TOKENS], lo, hi;
        for (int t = 0; t < T; t++) a[t] = b[t] = _mm256_setzero_ps();
        for (long k = k0; k < k0 + vec; k += 16) {
            widen(codes16(q, k, bits), bits, &lo, &hi);
            for (int t = 0; t < T; t++) {
                a[t] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x[t] + k), a[t]);
                b[t] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x[t] + k + 8), b[t]);
            }
        }
        float s = bf16_to_f32(m->scales[r * groups + g]);
        float z = m->zeros ? bf16_to_f32(m->zeros[r * groups + g]) : 0.0f;
        __m256 sv = _mm256_set1_ps(s);
        for (int t = 0; t < T; t++) {
            total[t] = _mm256_fmadd_ps(sv, _mm256_add_ps(a[t], b[t]), total[t]);
            float tail = 0;
            for (long k = k0 + vec; k < k0 + m->group; k++) tail += code_at(m, q, k) * x[t][k];
            offset[t] += s * tail + (m->zeros ? (z - mid * s) * xsum[t][g] : 0.0f);
        }
    }
    for (int t = 0; t < T; t++) y[t] = hsum(total[t]) + offset[t];
}

/* row_t instantiated for each (bits, tokens): both constant inside, so the unpacking has no branch and the
   accumulators no memory. */
#define ROW_CASES(B)                                                                                             \
    case B * 8 + 1: row_t(m, r, x, xsum, y, 1, B); break;                                                    \
    case B * 8 + 2: row_t(m, r, x, xsum, y, 2, B); break;                                                    \
    case B * 8 + 3: row_t(m, r, x, xsum, y, 3, B); break;                                                    \
    case B * 8 + 4: row_t(m, r, x, xsum, y, 4, B); break;

static void row(const qmat *m, long r, const float *const *x, const float *const *xsum, int T, float *y) {
    switch (m->bits * 8 + T) {
        ROW_CASES(8)
        ROW_CASES(4)
        ROW_CASES(2)
    }
}

/* Per token: x [K] in fp32 (from bf16 x, or fp32 xf) and its per-group sums (grouped precisions only). */
static void prepare(const qmat *m, const uint16_t *x, const float *xf, float *xs, float *xsum) {
    for (long k = 0; k < m->K; k++) xs[k] = xf ? xf[k] : bf16_to_f32(x[k]);
    if (m->zeros)
        for (long g = 0; g < m->K / m->group; g++) {
            float s = 0;
            for (long k = g * m->group; k < (g + 1) * m->group; k++) s += xs[k];
            xsum[g] = s;
        }
}

/* One SwiGLU expert for T <= MAX_TOKENS tokens x [T, H] bf16: y[t] = bf16(bf16(down . h) * weight[t]),
   h = bf16(bf16(silu(g)) * u), g, u = bf16(gate_up . x) — the reference's roundings, over quantized weights.
   scratch: at least T * (2H + 3I) floats. */
void moetier_swiglu_q(int bits, const uint8_t *gu_codes, const uint16_t *gu_scales, const uint16_t *gu_zeros,
                      long gu_group, const uint8_t *d_codes, const uint16_t *d_scales, const uint16_t *d_zeros,
                      long d_group, const uint16_t *x, const float *weight, uint16_t *y, long H, long I, int T,
                      float *scratch) {
    qmat gu = {bits, gu_codes, gu_scales, bits == 8 ? NULL : gu_zeros, 2 * I, H, bits == 8 ? H : gu_group};
    qmat dn = {bits, d_codes, d_scales, bits == 8 ? NULL : d_zeros, H, I, bits == 8 ? I : d_group};
    const float *xs[MAX_TOKENS], *xsum[MAX_TOKENS], *hs[MAX_TOKENS], *hsum[MAX_TOKENS];
    float *p = scratch;
    for (int t = 0; t < T; t++) {
        float *a = p, *b = p + H;
        prepare(&gu, x + t * H, NULL, a, b);
        xs[t] = a, xsum[t] = b;
        p += 2 * H;
    }
    float *h = p; /* [T, I] fp32 */
    p += T * I;
    for (int t = 0; t < T; t++) hs[t] = p + t * 2 * I, hsum[t] = p + t * 2 * I + I;
#pragma omp parallel if (3 * H * I * bits / 8 >= PARALLEL_MIN_BYTES)
    {
#pragma omp for schedule(static)
        for (long r = 0; r < I; r++) {
            float g[MAX_TOKENS], u[MAX_TOKENS];
            row(&gu, r, xs, xsum, T, g);
            row(&gu, I + r, xs, xsum, T, u);
            for (int t = 0; t < T; t++) {
                float gr = round_bf16(g[t]);
                h[t * I + r] = swiglu_bf16(gr, round_bf16(u[t]));
            }
        } /* barrier: every h is written before the down rows read it */
#pragma omp single
        for (int t = 0; t < T; t++) prepare(&dn, NULL, h + t * I, (float *)hs[t], (float *)hsum[t]);
#pragma omp for schedule(static)
        for (long k = 0; k < H; k++) {
            float d[MAX_TOKENS];
            row(&dn, k, hs, hsum, T, d);
            for (int t = 0; t < T; t++) y[t * H + k] = f32_to_bf16(round_bf16(d[t]) * weight[t]);
        }
    }
}

/* Eight fp32 values rounded to bf16 (nearest even; no NaN can come from finite codes and scales), packed. */
static inline __m128i to_bf16x8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}

/* The bf16 weights [N, K] a quantized matrix stands for, as dequantize() computes them: (q - mid) * s + z in fp32
   (a product, then a sum: no fused multiply-add, so the rounding is torch's), rounded once. */
__attribute__((optimize("fp-contract=off"))) void moetier_dequant_q(int bits, const uint8_t *codes,
                                                                   const uint16_t *scales, const uint16_t *zeros,
                                                                   long N, long K, long group, uint16_t *out) {
    if (bits == 8) group = K, zeros = NULL;
    qmat m = {bits, codes, scales, zeros, N, K, group};
    long groups = K / group, vec = group & ~15L, per = 8 / bits;
    float mid = bits == 8 ? 0.0f : (float)(1 << (bits - 1));
#pragma omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_BYTES)
    for (long r = 0; r < N; r++) {
        const uint8_t *q = codes + r * (K / per);
        uint16_t *o = out + r * K;
        for (long g = 0; g < groups; g++) {
            float s = bf16_to_f32(scales[r * groups + g]), z = zeros ? bf16_to_f32(zeros[r * groups + g]) : 0.0f;
            __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z), mv = _mm256_set1_ps(mid), lo, hi;
            long k0 = g * group, k = k0;
            for (; k < k0 + vec; k += 16) {
                widen(codes16(q, k, bits), bits, &lo, &hi);
                lo = _mm256_mul_ps(_mm256_sub_ps(lo, mv), sv);
                hi = _mm256_mul_ps(_mm256_sub_ps(hi, mv), sv);
                if (zeros) lo = _mm256_add_ps(lo, zv), hi = _mm256_add_ps(hi, zv);
                _mm_storeu_si128((__m128i *)(o + k), to_bf16x8(lo));
                _mm_storeu_si128((__m128i *)(o + k + 8), to_bf16x8(hi));
            }
            for (; k < k0 + group; k++) {
                float v = (code_at(&m, q, k) - mid) * s;
                o[k] = f32_to_bf16(zeros ? v + z : v);
            }
        }
    }
}
