/* Matrices in GGML's block formats (GGUF's Q8_0, Q4_K, Q5_K, Q6_K; moetier/quant/ggml_blocks.py has their
   layouts) times a few tokens' activations, by integer dot products as llama.cpp computes them: each activation
   row quantized to int8 blocks — Q8_K for the k-quants (256 inputs, a float scale, the sums of each 16 codes),
   Q8_0-like for Q8_0 (32 inputs, a float scale where ggml keeps an fp16 one) — and the weights' codes meeting them
   in uint8 x int8 multiply-adds into int16 pairs (vpmaddubsw), widened by their sub-block scales (vpmaddwd):
   ggml's own arithmetic for these types, written again here for this engine's calls (rows in parallel, up to
   GQ_MAX_TOKENS tokens a pass, the weights read once for all of them).

   Exact integer sums: Q4_K codes <= 15, Q5_K <= 31, Q6_K <= 63 (the -32 taken off through the bsums) against
   |xq| <= 127: a vpmaddubsw pair is at most 63 * 127 * 2 = 16,002, within int16; a super-block's sum within int32.
   Per super-block and token the result is
     q4_k/q5_k: d * dx * sum_j sc_j * <q_j, xq_j>  -  dmin * dx * sum_j m_j * (sum of xq over sub-block j)
     q6_k:      d * dx * sum_j sc_j * (<q_j, xq_j> - 32 * sum of xq over j)
     q8_0:      per 32: d * dx * <q, xq>.
   Against the dequantized weights the difference is the activation's rounding to int8, as in llama.cpp. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define GQ_MAX_TOKENS 4
#define GQ_PARALLEL_MIN_BYTES (128 * 1024)
#define QK 256

enum { GQ_Q8_0 = 0, GQ_Q4_K = 1, GQ_Q5_K = 2, GQ_Q6_K = 3 };

/* Bytes of one block and the inputs it covers, per type (ggml's). */
static const long TYPE_SIZE[] = {34, 144, 176, 210};
static const long BLOCK_SIZE[] = {32, QK, QK, QK};

typedef struct { /* one token's activation for a k-quant matrix, per 256 inputs */
    float d;
    int8_t qs[QK];
    int16_t bsums[QK / 16];
} q8k;

typedef struct { /* ...for a Q8_0 matrix, per 32 inputs */
    float d;
    int8_t qs[32];
} q8b;

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

long moetier_gq_act_bytes(int type, long K) {
    return type == GQ_Q8_0 ? K / 32 * (long)sizeof(q8b) : K / QK * (long)sizeof(q8k);
}

/* ggml's quantize_row_q8_K: the scale from the signed value of largest magnitude, -127 / it, codes rounded to
   nearest (ties even, as ggml's nearest_int), at most 127. */
static void quantize_q8k(const float *x, long K, q8k *y) {
    for (long b = 0; b < K / QK; b++, x += QK) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK; j++)
            if (fabsf(x[j]) > amax) amax = fabsf(x[j]), max = x[j];
        if (amax == 0.0f) {
            memset(&y[b], 0, sizeof(q8k));
            continue;
        }
        const float iscale = -127.0f / max;
        for (int j = 0; j < QK; j++) {
            int v = (int)nearbyintf(iscale * x[j]);
            y[b].qs[j] = (int8_t)(v > 127 ? 127 : v);
        }
        for (int j = 0; j < QK / 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += y[b].qs[j * 16 + i];
            y[b].bsums[j] = (int16_t)s;
        }
        y[b].d = 1.0f / iscale;
    }
}

static void quantize_q8b(const float *x, long K, q8b *y) {
    for (long b = 0; b < K / 32; b++, x += 32) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < 32; j++) y[b].qs[j] = (int8_t)nearbyintf(x[j] * id);
        y[b].d = d;
    }
}

/* x [T, K] fp32 -> T activations for a matrix of `type`, back to back in `out` (moetier_gq_act_bytes each). */
void moetier_gq_quantize_act(int type, const float *x, long K, int T, void *out) {
    const long bytes = moetier_gq_act_bytes(type, K);
    for (int t = 0; t < T; t++) {
        if (type == GQ_Q8_0)
            quantize_q8b(x + t * K, K, (q8b *)((char *)out + t * bytes));
        else
            quantize_q8k(x + t * K, K, (q8k *)((char *)out + t * bytes));
    }
}

static inline int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* 32 codes (uint8, <= 63) times 32 activation codes, each 16-input half scaled by its own int16: int32 x 8. */
static inline __m256i dot32_scaled(__m256i q, const int8_t *x, __m256i scales16) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)x)), scales16);
}

/* The 8 six-bit scales and mins of a q4_k/q5_k block (ggml's get_scale_min_k4). */
static inline void scale_min_k4(const uint8_t *q, uint8_t *sc, uint8_t *m) {
    for (int j = 0; j < 4; j++) sc[j] = q[j] & 63, m[j] = q[j + 4] & 63;
    for (int j = 4; j < 8; j++) {
        sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* A q4_k or q5_k super-block against one token's q8k block. */
static inline float dot_q45k(const uint8_t *blk, const q8k *a, const int five) {
    uint8_t sc[8], mn[8];
    scale_min_k4(blk + 4, sc, mn);
    const uint8_t *qs = blk + (five ? 48 : 16), *qh = blk + 16;
    const __m256i low = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    __m256i hbits = five ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    __m256i acc = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) { /* 64 weights: sub-block 2c in the low nibbles, 2c + 1 in the high */
        __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
        if (five) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hbits, one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 1), one), 4));
            hbits = _mm256_srli_epi16(hbits, 2);
        }
        acc = _mm256_add_epi32(acc, dot32_scaled(lo, a->qs + 64 * c, _mm256_set1_epi16(sc[2 * c])));
        acc = _mm256_add_epi32(acc, dot32_scaled(hi, a->qs + 64 * c + 32, _mm256_set1_epi16(sc[2 * c + 1])));
    }
    int summ = 0;
    for (int j = 0; j < 8; j++) summ += mn[j] * (a->bsums[2 * j] + a->bsums[2 * j + 1]);
    return f16_to_f32(blk) * a->d * (float)hsum_i32(acc) - f16_to_f32(blk + 2) * a->d * (float)summ;
}

static inline __m256i two_scales(const int8_t *sc) { /* two int8 scales, each over 8 int16 lanes */
    return _mm256_setr_m128i(_mm_set1_epi16(sc[0]), _mm_set1_epi16(sc[1]));
}

/* A q6_k super-block against one token's q8k block. */
static inline float dot_q6k(const uint8_t *blk, const q8k *a) {
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t *sc = (const int8_t *)(blk + 192);
    const __m256i low = _mm256_set1_epi8(0xF), three = _mm256_set1_epi8(3);
    __m256i acc = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) { /* 128 weights: four runs of 32, each two sub-blocks of 16 */
        __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
        __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
        __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        __m256i q0 = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_slli_epi16(_mm256_and_si256(hb, three), 4));
        __m256i q1 = _mm256_or_si256(_mm256_and_si256(l1, low),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), three), 4));
        __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), three), 4));
        __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), three), 4));
        const int8_t *x = a->qs + 128 * h, *s = sc + 8 * h;
        acc = _mm256_add_epi32(acc, dot32_scaled(q0, x, two_scales(s)));
        acc = _mm256_add_epi32(acc, dot32_scaled(q1, x + 32, two_scales(s + 2)));
        acc = _mm256_add_epi32(acc, dot32_scaled(q2, x + 64, two_scales(s + 4)));
        acc = _mm256_add_epi32(acc, dot32_scaled(q3, x + 96, two_scales(s + 6)));
    }
    int bias = 0; /* the codes are stored + 32 */
    for (int j = 0; j < 16; j++) bias += sc[j] * a->bsums[j];
    return f16_to_f32(blk + 208) * a->d * (float)(hsum_i32(acc) - 32 * bias);
}

/* A q8_0 block against one token's block: |xq| times q with xq's sign (pairs of at most 127 * 127 * 2). */
static inline float dot_q8_0(const uint8_t *blk, const q8b *a) {
    __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 2)), x = _mm256_loadu_si256((const __m256i *)a->qs);
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)),
                                  _mm256_set1_epi16(1));
    return f16_to_f32(blk) * a->d * (float)hsum_i32(p);
}

/* One row's blocks against T tokens' activations. */
static inline __attribute__((always_inline)) void row_dot(int type, const uint8_t *w, long K, const char *act,
                                                         long act_bytes, int T, float *out) {
    const long blocks = K / BLOCK_SIZE[type], ts = TYPE_SIZE[type];
    float sum[GQ_MAX_TOKENS] = {0};
    for (long b = 0; b < blocks; b++) {
        const uint8_t *blk = w + b * ts;
        for (int t = 0; t < T; t++) {
            const char *a = act + t * act_bytes;
            switch (type) {
                case GQ_Q8_0: sum[t] += dot_q8_0(blk, (const q8b *)a + b); break;
                case GQ_Q4_K: sum[t] += dot_q45k(blk, (const q8k *)a + b, 0); break;
                case GQ_Q5_K: sum[t] += dot_q45k(blk, (const q8k *)a + b, 1); break;
                default: sum[t] += dot_q6k(blk, (const q8k *)a + b);
            }
        }
    }
    for (int t = 0; t < T; t++) out[t] = sum[t];
}

int moetier_gq_fits(int type, long K) {
    return type >= GQ_Q8_0 && type <= GQ_Q6_K && K > 0 && K % BLOCK_SIZE[type] == 0;
}

/* y [T, N] fp32 = W [N, K] (`type` blocks, rows back to back) x the T activations `act` (moetier_gq_quantize_act's),
   T <= GQ_MAX_TOKENS. Rows in parallel where the matrix is big enough to pay for the threads. */
void moetier_gq_linear(int type, const uint8_t *w, long N, long K, const void *act, int T, float *y) {
    const long row_bytes = K / BLOCK_SIZE[type] * TYPE_SIZE[type], act_bytes = moetier_gq_act_bytes(type, K);
#pragma omp parallel for schedule(static) if (N * row_bytes >= GQ_PARALLEL_MIN_BYTES)
    for (long r = 0; r < N; r++) {
        float out[GQ_MAX_TOKENS];
        row_dot(type, w + r * row_bytes, K, (const char *)act, act_bytes, T, out);
        for (int t = 0; t < T; t++) y[t * N + r] = out[t];
    }
}
