/* Matrices in GGML's block formats (GGUF's Q8_0, Q4_K, Q5_K, Q6_K, the legacy Q4_0/Q4_1/Q5_0/Q5_1, gpt-oss's
   MXFP4; moetier/quant/ggml_blocks.py has their layouts) times a few tokens' activations, by integer dot products
   as llama.cpp computes them: each activation row quantized to int8 blocks — Q8_K for the k-quants (256 inputs, a
   float scale, the sums of each 16 codes), Q8_0-like for Q8_0, the legacy types and MXFP4 (32 inputs, a float
   scale where ggml keeps an fp16 one) — and the weights' codes meeting them in uint8 x int8 multiply-adds into
   int16 pairs (vpmaddubsw), widened by their sub-block scales (vpmaddwd): ggml's own arithmetic for these types,
   written again here for this engine's calls (rows in parallel, up to GQ_MAX_TOKENS tokens a pass, the weights
   read once for all of them).

   Exact integer sums: Q4_K codes <= 15, Q5_K <= 31, Q6_K <= 63 (the -32 taken off through the bsums) against
   |xq| <= 127: a vpmaddubsw pair is at most 63 * 127 * 2 = 16,002, within int16; a super-block's sum within int32.
   Per super-block and token the result is
     q4_k/q5_k: d * dx * sum_j sc_j * <q_j, xq_j>  -  dmin * dx * sum_j m_j * (sum of xq over sub-block j)
     q6_k:      d * dx * sum_j sc_j * (<q_j, xq_j> - 32 * sum of xq over j)
     q8_0:      per 32: d * dx * <q, xq>
     mxfp4:     per 32: 2^(e - 128) * dx * <2v, xq> (v the E2M1 values, doubled: integers of at most 12).
   Against the dequantized weights the difference is the activation's rounding to int8, as in llama.cpp. */

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define GQ_MAX_TOKENS 4
#define GQ_TILE_BYTES (16 * 1024) /* a tile of rows' blocks, met by every pass of tokens (moetier_gq_linear_tokens) */
#define GQ_PARALLEL_MIN_BYTES (128 * 1024)
#define GQ_PREFETCH_AHEAD 2048 /* bytes: a row or two of a k-quant expert matrix, ahead of the hardware prefetcher
                                  (as q_int.c): a Q4_K gate_up from memory 307 -> 140 us (docs/gguf.md) */
#define QK 256
#define INLINE static inline __attribute__((always_inline)) /* into each row function: T a constant */

enum { GQ_Q8_0 = 0, GQ_Q4_K = 1, GQ_Q5_K = 2, GQ_Q6_K = 3, GQ_Q4_0 = 4, GQ_Q4_1 = 5, GQ_Q5_0 = 6, GQ_Q5_1 = 7,
       GQ_MXFP4 = 8, GQ_TYPES = 9 };

/* Bytes of one block and the inputs it covers, per type (ggml's). */
static const long TYPE_SIZE[] = {34, 144, 176, 210, 18, 20, 22, 24, 17};
static const long BLOCK_SIZE[] = {32, QK, QK, QK, 32, 32, 32, 32, 32};

/* MXFP4 (gpt-oss's experts): E2M1 codes as ggml's kvalues_mxfp4 — the values doubled, so integers — and a block's
   E8M0 exponent e standing for 2^(e - 128), the doubling taken back (ggml's GGML_E8M0_TO_FP32_HALF; e < 2 gives a
   subnormal float, exact). */
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#define MXFP4_OFFSET 12
static const uint8_t MXFP4_UNSIGNED[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0}; /* + 12 */

/* 2^(e - 128) for each E8M0 exponent e: a block's scale, looked up (computed from e's bits it took a dozen scalar
   instructions a block in the kernel, more than the block's vector work). */
static const float E8M0_HALF[256] = {
    0x1p-128f, 0x1p-127f, 0x1p-126f, 0x1p-125f, 0x1p-124f, 0x1p-123f, 0x1p-122f, 0x1p-121f,
    0x1p-120f, 0x1p-119f, 0x1p-118f, 0x1p-117f, 0x1p-116f, 0x1p-115f, 0x1p-114f, 0x1p-113f,
    0x1p-112f, 0x1p-111f, 0x1p-110f, 0x1p-109f, 0x1p-108f, 0x1p-107f, 0x1p-106f, 0x1p-105f,
    0x1p-104f, 0x1p-103f, 0x1p-102f, 0x1p-101f, 0x1p-100f, 0x1p-99f, 0x1p-98f, 0x1p-97f,
    0x1p-96f, 0x1p-95f, 0x1p-94f, 0x1p-93f, 0x1p-92f, 0x1p-91f, 0x1p-90f, 0x1p-89f,
    0x1p-88f, 0x1p-87f, 0x1p-86f, 0x1p-85f, 0x1p-84f, 0x1p-83f, 0x1p-82f, 0x1p-81f,
    0x1p-80f, 0x1p-79f, 0x1p-78f, 0x1p-77f, 0x1p-76f, 0x1p-75f, 0x1p-74f, 0x1p-73f,
    0x1p-72f, 0x1p-71f, 0x1p-70f, 0x1p-69f, 0x1p-68f, 0x1p-67f, 0x1p-66f, 0x1p-65f,
    0x1p-64f, 0x1p-63f, 0x1p-62f, 0x1p-61f, 0x1p-60f, 0x1p-59f, 0x1p-58f, 0x1p-57f,
    0x1p-56f, 0x1p-55f, 0x1p-54f, 0x1p-53f, 0x1p-52f, 0x1p-51f, 0x1p-50f, 0x1p-49f,
    0x1p-48f, 0x1p-47f, 0x1p-46f, 0x1p-45f, 0x1p-44f, 0x1p-43f, 0x1p-42f, 0x1p-41f,
    0x1p-40f, 0x1p-39f, 0x1p-38f, 0x1p-37f, 0x1p-36f, 0x1p-35f, 0x1p-34f, 0x1p-33f,
    0x1p-32f, 0x1p-31f, 0x1p-30f, 0x1p-29f, 0x1p-28f, 0x1p-27f, 0x1p-26f, 0x1p-25f,
    0x1p-24f, 0x1p-23f, 0x1p-22f, 0x1p-21f, 0x1p-20f, 0x1p-19f, 0x1p-18f, 0x1p-17f,
    0x1p-16f, 0x1p-15f, 0x1p-14f, 0x1p-13f, 0x1p-12f, 0x1p-11f, 0x1p-10f, 0x1p-9f,
    0x1p-8f, 0x1p-7f, 0x1p-6f, 0x1p-5f, 0x1p-4f, 0x1p-3f, 0x1p-2f, 0x1p-1f,
    0x1p0f, 0x1p1f, 0x1p2f, 0x1p3f, 0x1p4f, 0x1p5f, 0x1p6f, 0x1p7f,
    0x1p8f, 0x1p9f, 0x1p10f, 0x1p11f, 0x1p12f, 0x1p13f, 0x1p14f, 0x1p15f,
    0x1p16f, 0x1p17f, 0x1p18f, 0x1p19f, 0x1p20f, 0x1p21f, 0x1p22f, 0x1p23f,
    0x1p24f, 0x1p25f, 0x1p26f, 0x1p27f, 0x1p28f, 0x1p29f, 0x1p30f, 0x1p31f,
    0x1p32f, 0x1p33f, 0x1p34f, 0x1p35f, 0x1p36f, 0x1p37f, 0x1p38f, 0x1p39f,
    0x1p40f, 0x1p41f, 0x1p42f, 0x1p43f, 0x1p44f, 0x1p45f, 0x1p46f, 0x1p47f,
    0x1p48f, 0x1p49f, 0x1p50f, 0x1p51f, 0x1p52f, 0x1p53f, 0x1p54f, 0x1p55f,
    0x1p56f, 0x1p57f, 0x1p58f, 0x1p59f, 0x1p60f, 0x1p61f, 0x1p62f, 0x1p63f,
    0x1p64f, 0x1p65f, 0x1p66f, 0x1p67f, 0x1p68f, 0x1p69f, 0x1p70f, 0x1p71f,
    0x1p72f, 0x1p73f, 0x1p74f, 0x1p75f, 0x1p76f, 0x1p77f, 0x1p78f, 0x1p79f,
    0x1p80f, 0x1p81f, 0x1p82f, 0x1p83f, 0x1p84f, 0x1p85f, 0x1p86f, 0x1p87f,
    0x1p88f, 0x1p89f, 0x1p90f, 0x1p91f, 0x1p92f, 0x1p93f, 0x1p94f, 0x1p95f,
    0x1p96f, 0x1p97f, 0x1p98f, 0x1p99f, 0x1p100f, 0x1p101f, 0x1p102f, 0x1p103f,
    0x1p104f, 0x1p105f, 0x1p106f, 0x1p107f, 0x1p108f, 0x1p109f, 0x1p110f, 0x1p111f,
    0x1p112f, 0x1p113f, 0x1p114f, 0x1p115f, 0x1p116f, 0x1p117f, 0x1p118f, 0x1p119f,
    0x1p120f, 0x1p121f, 0x1p122f, 0x1p123f, 0x1p124f, 0x1p125f, 0x1p126f, 0x1p127f,
};

static inline int is_k(int type) { return type >= GQ_Q4_K && type <= GQ_Q6_K; }

typedef struct { /* one token's activation for a k-quant matrix, per 256 inputs */
    float d;
    int8_t qs[QK];
    int16_t bsums[QK / 16];
    int16_t sums32[QK / 32]; /* of each 32 (bsums in pairs): a Q4_K/Q5_K row's mins meet them, once per token */
} q8k;

typedef struct { /* ...for a Q8_0, legacy (Q4_0, Q4_1, Q5_0, Q5_1) or MXFP4 matrix, per 32 inputs */
    float d;
    int32_t sum; /* of qs: the legacy formats' offsets (- 8, - 16) and minimums (+ m) meet it; for MXFP4 the sum
                    times -MXFP4_OFFSET, its offset's term whole (a row's every block adds it) */
    int8_t qs[32];
} q8b;

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* MXFP4's activation for eight blocks b..b + 7 (whole eights of a row; oct_mxfp4): their sums and scales in the
   order oct_mxfp4 meets its blocks' products — [b, b + 2, b + 4, b + 6, b + 1, b + 3, b + 5, b + 7] — so each is
   one load. After the row's q8b blocks. */
typedef struct {
    int32_t sum[8];
    float d[8];
} q8b_oct;

long moetier_gq_act_bytes(int type, long K) {
    if (is_k(type)) return K / QK * (long)sizeof(q8k);
    return K / 32 * (long)sizeof(q8b) + (type == GQ_MXFP4 ? K / 256 * (long)sizeof(q8b_oct) : 0);
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
        for (int j = 0; j < QK / 32; j++) y[b].sums32[j] = (int16_t)(y[b].bsums[2 * j] + y[b].bsums[2 * j + 1]);
        y[b].d = 1.0f / iscale;
    }
}

static void quantize_q8b(const float *x, long K, q8b *y, int sum_times) {
    for (long b = 0; b < K / 32; b++, x += 32) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) y[b].qs[j] = (int8_t)nearbyintf(x[j] * id), sum += y[b].qs[j];
        y[b].d = d, y[b].sum = sum * sum_times;
    }
}

/* MXFP4's activation in pairs of blocks (pair_mxfp4): the second half of block b's codes swapped with the first
   half of b + 1's, for each whole pair; a last odd block stays as it is (blk_mxfp4 computes it). */
static void pair_q8b(q8b *y, long blocks) {
    for (long b = 0; b + 1 < blocks; b += 2) {
        int8_t half[16];
        memcpy(half, y[b].qs + 16, 16);
        memcpy(y[b].qs + 16, y[b + 1].qs, 16);
        memcpy(y[b + 1].qs, half, 16);
    }
}

/* The octets' sums and scales of a row's K / 32 q8b blocks y (q8b_oct), after them. */
static void oct_q8b(q8b *y, long blocks) {
    q8b_oct *o = (q8b_oct *)(y + blocks);
    for (long g = 0; g < blocks / 8; g++)
        for (int j = 0; j < 8; j++) {
            const q8b *x = y + 8 * g + (j < 4 ? 2 * j : 2 * (j - 4) + 1);
            o[g].sum[j] = x->sum, o[g].d[j] = x->d;
        }
}

static void quantize_act_row(int type, const float *x, long K, void *out) {
    if (is_k(type)) {
        quantize_q8k(x, K, (q8k *)out);
    } else if (type == GQ_MXFP4) {
        quantize_q8b(x, K, (q8b *)out, -MXFP4_OFFSET);
        pair_q8b((q8b *)out, K / 32);
        oct_q8b((q8b *)out, K / 32);
    } else {
        quantize_q8b(x, K, (q8b *)out, 1);
    }
}

/* x [T, K] fp32 -> T activations for a matrix of `type`, back to back in `out` (moetier_gq_act_bytes each). */
void moetier_gq_quantize_act(int type, const float *x, long K, int T, void *out) {
    const long bytes = moetier_gq_act_bytes(type, K);
    if (T <= GQ_MAX_TOKENS) { /* (a decode step's: no parallel region, called inside one) */
        for (int t = 0; t < T; t++) quantize_act_row(type, x + t * K, K, (char *)out + t * bytes);
        return;
    }
#pragma omp parallel for schedule(static) /* a prompt's rows: each token on its own */
    for (int t = 0; t < T; t++) quantize_act_row(type, x + t * K, K, (char *)out + t * bytes);
}

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hsum_ps128(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* acc + madd(a, b) (int16 pairs multiplied and summed into int32) and acc + the uint8 x int8 products of u and x
   summed by fours: one instruction each with AVX-512 VNNI (vpdpwssd, vpdpbusd on 256-bit registers), two or three
   without. The same integer sums either way — neither saturates here (see the top), and int32 adds associate — so
   each library computes the same bits. (Measured on a Zen 4 at 2-4 tokens, where these kernels are compute-bound
   on a batch's rows: docs/performance.md "A server's batch".) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
static inline __m256i dot4_acc(__m256i acc, __m256i u, __m256i x) { return _mm256_dpbusd_epi32(acc, u, x); }
static inline __m256i dot4x2(__m256i u0, __m256i x0, __m256i u1, __m256i x1) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u0, x0), u1, x1);
}
#elif defined(__AVXVNNI__) /* the same instructions VEX-encoded: AVX-VNNI, without AVX-512 (Alder Lake on) */
static inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
static inline __m256i dot4_acc(__m256i acc, __m256i u, __m256i x) { return _mm256_dpbusd_avx_epi32(acc, u, x); }
static inline __m256i dot4x2(__m256i u0, __m256i x0, __m256i u1, __m256i x1) {
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u0, x0), u1, x1);
}
#else
static inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}
static inline __m256i dot4_acc(__m256i acc, __m256i u, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}
/* (u0 . x0 + u1 . x1 by fours, for codes u of at most 24 — MXFP4's: the int16 pairs of both added before they are
   widened, at most 2 * 2 * 24 * 127, within int16) */
static inline __m256i dot4x2(__m256i u0, __m256i x0, __m256i u1, __m256i x1) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, x0), _mm256_maddubs_epi16(u1, x1));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
#endif

/* Byte masks for vpshufb: int16 lane i of a 128-bit half broadcast over the half (BROADCAST16[i]); and, from 16
   int8, byte 2i over 8 bytes then byte 2i + 1 over 8 (PAIR8[i]: two sub-blocks' scales, widened after). */
static const uint8_t BROADCAST16[8][32] = {
#define B16(i) {2*i, 2*i+1, 2*i, 2*i+1, 2*i, 2*i+1, 2*i, 2*i+1, 2*i, 2*i+1, 2*i, 2*i+1, 2*i, 2*i+1, 2*i, 2*i+1, \
                2*i, 2*i+1, 2*i, 2*i+1, 2*i, 2*i+1, 2*i, 2*i+1, 2*i, 2*i+1, 2*i, 2*i+1, 2*i, 2*i+1, 2*i, 2*i+1}
    B16(0), B16(1), B16(2), B16(3), B16(4), B16(5), B16(6), B16(7)
#undef B16
};
static const uint8_t PAIR8[8][16] = {
#define P8(i) {2*i, 2*i, 2*i, 2*i, 2*i, 2*i, 2*i, 2*i, 2*i+1, 2*i+1, 2*i+1, 2*i+1, 2*i+1, 2*i+1, 2*i+1, 2*i+1}
    P8(0), P8(1), P8(2), P8(3), P8(4), P8(5), P8(6), P8(7)
#undef P8
};

/* The 8 six-bit scales (bytes 0-7) and mins (8-15) of a q4_k/q5_k block, unpacked as ggml's AVX2 path does. */
static inline __m256i scales_mins_k4(const uint8_t *q) {
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    uint32_t u[4];
    memcpy(u, q, 12);
    u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
    const uint32_t mins_low = u[1] & kmask1;
    u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
    u[2] = mins_low;
    u[0] &= kmask1;
    return _mm256_cvtepu8_epi16(_mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]));  /* int16 x 16 */
}

/* A q4_k or q5_k super-block against T tokens' q8k blocks a[t]: each token's scaled sum into acc[t], its mins'
   into accm[t]. A run of 64 weights (two sub-blocks) at a time is unpacked and met by every token before the next:
   with the codes of the whole block unpacked first (eight registers) and the scales shuffled for each token, T > 1
   ran out of AVX2's sixteen registers. The integer sums are the same in any order. */
INLINE void blk_q45k(const uint8_t *blk, const q8k *const *a, const int T, __m256 *acc, __m128 *accm,
                     const int five) {
    const __m256i sm = scales_mins_k4(blk + 4);
    const __m128i mins = _mm256_extracti128_si256(sm, 1);
    const __m256i scales = _mm256_permute2x128_si256(sm, sm, 0x00);  /* the 8 scales in both halves */
    const uint8_t *qs = blk + (five ? 48 : 16), *qh = blk + 16;
    const __m256i low = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    __m256i hbits = five ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    __m256i sumi[GQ_MAX_TOKENS], sumh[GQ_MAX_TOKENS]; /* the low and the high sub-blocks' sums: two chains */
    for (int t = 0; t < T; t++) sumi[t] = sumh[t] = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) { /* 64 weights: sub-block 2c in the low nibbles, 2c + 1 in the high */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if (five) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hbits, one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 1), one), 4));
            hbits = _mm256_srli_epi16(hbits, 2);
        }
        const __m256i sc_lo = _mm256_shuffle_epi8(scales, _mm256_loadu_si256((const __m256i *)BROADCAST16[2 * c]));
        const __m256i sc_hi =
            _mm256_shuffle_epi8(scales, _mm256_loadu_si256((const __m256i *)BROADCAST16[2 * c + 1]));
        for (int t = 0; t < T; t++) {
            const __m256i *x = (const __m256i *)(a[t]->qs + 64 * c);
            sumi[t] = madd_acc(sumi[t], sc_lo, _mm256_maddubs_epi16(lo, _mm256_loadu_si256(x)));
            sumh[t] = madd_acc(sumh[t], sc_hi, _mm256_maddubs_epi16(hi, _mm256_loadu_si256(x + 1)));
        }
    }
    for (int t = 0; t < T; t++) sumi[t] = _mm256_add_epi32(sumi[t], sumh[t]);
    const float d = f16_to_f32(blk), dmin = f16_to_f32(blk + 2);
    for (int t = 0; t < T; t++) {
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[t]->d), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        const __m128i sums32 = _mm_loadu_si128((const __m128i *)a[t]->sums32);
        accm[t] = _mm_fmadd_ps(_mm_set1_ps(dmin * a[t]->d), _mm_cvtepi32_ps(_mm_madd_epi16(mins, sums32)), accm[t]);
    }
}

/* A q6_k super-block against T tokens' q8k blocks: codes stored + 32, taken off through the bsums. As blk_q45k, a
   run of 32 weights (two sub-blocks of 16) is unpacked and met by every token before the next. */
INLINE void blk_q6k(const uint8_t *blk, const q8k *const *a, const int T, __m256 *acc) {
    const uint8_t *ql = blk, *qh = blk + 128;
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(blk + 192));
    const __m256i low = _mm256_set1_epi8(0xF), three = _mm256_set1_epi8(3);
    __m256i sumi[GQ_MAX_TOKENS], sumo[GQ_MAX_TOKENS]; /* the even and the odd runs' sums: two chains */
    for (int t = 0; t < T; t++) sumi[t] = sumo[t] = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) { /* 128 weights: four runs of 32, each two sub-blocks of 16 */
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        for (int s = 0; s < 4; s++) { /* run s: l0's or l1's low or high nibbles, hb's bits 2s and 2s + 1 */
            const __m256i l = s & 1 ? l1 : l0, nib = s < 2 ? l : _mm256_srli_epi16(l, 4);
            const __m256i top = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * s), three);
            const __m256i q = _mm256_or_si256(_mm256_and_si256(nib, low), _mm256_slli_epi16(top, 4));
            const int v = 4 * h + s;
            const __m256i scale =
                _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, _mm_loadu_si128((const __m128i *)PAIR8[v])));
            for (int t = 0; t < T; t++) {
                const __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(a[t]->qs + 32 * v)));
                if (s & 1) sumo[t] = madd_acc(sumo[t], scale, p);
                else sumi[t] = madd_acc(sumi[t], scale, p);
            }
        }
    }
    for (int t = 0; t < T; t++) sumi[t] = _mm256_add_epi32(sumi[t], sumo[t]);
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);  /* the 16 scales, for the bias */
    const float d = f16_to_f32(blk + 208);
    for (int t = 0; t < T; t++) {
        const __m256i bias = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)a[t]->bsums));
        const __m256i s = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32(bias, 5));
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[t]->d), _mm256_cvtepi32_ps(s), acc[t]);
    }
}

/* A q8_0 block against T tokens' blocks: |xq| times q with xq's sign (pairs of at most 127 * 127 * 2). */
INLINE void blk_q8_0(const uint8_t *blk, const q8b *const *a, int T, __m256 *acc) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 2)), aq = _mm256_sign_epi8(q, q);
    const float d = f16_to_f32(blk);
    for (int t = 0; t < T; t++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)a[t]->qs);
        const __m256i p = dot4_acc(_mm256_setzero_si256(), aq, _mm256_sign_epi8(x, q));
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[t]->d), _mm256_cvtepi32_ps(p), acc[t]);
    }
}

/* 32 bits (little-endian) -> 32 bytes, 0xFF where the bit is set (ggml's bytes_from_bits_32). */
static inline __m256i bytes_from_bits(const uint8_t *p) {
    uint32_t x;
    memcpy(&x, p, 4);
    const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuffle),
                                          _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

/* A legacy block (Q4_0, Q4_1, Q5_0, Q5_1) against T tokens' q8b blocks: its 32 codes unsigned (the nibbles, the
   fifth bits), the offset (- 8, - 16) taken off through the activation's sum in integers, a minimum (+ m) as a
   float term: d dx (sum q x - off sum x) + m dx sum x. */
INLINE void blk_legacy(const uint8_t *blk, const q8b *const *a, int T, __m256 *acc, __m128 *accm, const int type) {
    const int has_m = type == GQ_Q4_1 || type == GQ_Q5_1, five = type == GQ_Q5_0 || type == GQ_Q5_1;
    const uint8_t *qh = blk + (has_m ? 4 : 2), *qs = qh + (five ? 4 : 0);
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(0xF);
    __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
    if (five) q = _mm256_or_si256(q, _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10)));
    const int off = type == GQ_Q4_0 ? 8 : type == GQ_Q5_0 ? 16 : 0;
    const float d = f16_to_f32(blk), m = has_m ? f16_to_f32(blk + 2) : 0.0f;
    for (int t = 0; t < T; t++) {
        const __m256i p = dot4_acc(_mm256_setr_epi32(-off * a[t]->sum, 0, 0, 0, 0, 0, 0, 0), q,
                                   _mm256_loadu_si256((const __m256i *)a[t]->qs));
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[t]->d), _mm256_cvtepi32_ps(p), acc[t]);
        if (has_m) accm[t] = _mm_sub_ss(accm[t], _mm_set_ss(m * a[t]->d * (float)a[t]->sum));
    }
}

/* An MXFP4 block against T tokens' q8b blocks: the nibbles (low: weights 0-15, high: 16-31) looked up as their
   values + 12 (unsigned, at most 24: uint8 x int8 products as the legacy formats' codes, no sign juggling), the 12
   taken off through the activation's sum in integers (pairs of at most 2 * 24 * 127), then 2^(e - 128) * dx. */
INLINE void blk_mxfp4(const uint8_t *blk, const q8b *const *a, int T, __m256 *acc) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 1)), low = _mm_set1_epi8(0xF);
    const __m128i lut = _mm_loadu_si128((const __m128i *)MXFP4_UNSIGNED);
    const __m256i q = _mm256_set_m128i(_mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(v, 4), low)),
                                       _mm_shuffle_epi8(lut, _mm_and_si128(v, low)));
    const float d = E8M0_HALF[blk[0]];
    for (int t = 0; t < T; t++) {
        const __m256i p = dot4_acc(_mm256_setr_epi32(a[t]->sum, 0, 0, 0, 0, 0, 0, 0), q, /* (sum: x -12) */
                                   _mm256_loadu_si256((const __m256i *)a[t]->qs));
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[t]->d), _mm256_cvtepi32_ps(p), acc[t]);
    }
}

/* Two MXFP4 blocks at once (b at blk, b + 1 right after it) against T tokens' q8b blocks laid out in pairs
   (quantize_q8b for MXFP4: block b's codes then b + 1's are x_b[0:16] x_b+1[0:16], then x_b[16:32] x_b+1[16:32]):
   the two blocks' nibbles unpacked in 256-bit registers, b's in the low 128-bit lane and b + 1's in the high one,
   each lane's sums and scale its own block's. Half the unpacking and shuffling a block of blk_mxfp4, whose 128-bit
   unpacking bound MXFP4's 2880-wide rows at one token to ~25 GB/s on a Zen 4's two cores. */
INLINE void pair_mxfp4(const uint8_t *blk, const q8b *const *a, int T, __m256 *acc) {
    const __m256i v = _mm256_loadu2_m128i((const __m128i *)(blk + 17 + 1), (const __m128i *)(blk + 1));
    const __m256i low = _mm256_set1_epi8(0xF);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MXFP4_UNSIGNED));
    const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, low));  /* weights 0-15 of b | of b + 1 */
    const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));  /* 16-31 */
    const float d0 = E8M0_HALF[blk[0]], d1 = E8M0_HALF[blk[17]];
    for (int t = 0; t < T; t++) {
        const q8b *x = a[t];
        const __m256i p = _mm256_add_epi32(dot4x2(lo, _mm256_loadu_si256((const __m256i *)x[0].qs), hi,
                                                  _mm256_loadu_si256((const __m256i *)x[1].qs)),
                                           _mm256_setr_epi32(x[0].sum, 0, 0, 0, x[1].sum, 0, 0, 0));
        const __m256 s = _mm256_setr_m128(_mm_set1_ps(d0 * x[0].d), _mm_set1_ps(d1 * x[1].d));
        acc[t] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(p), acc[t]);
    }
}

/* 2^(e - 128) for eight E8M0 exponents e (int32 lanes, 0-255): E8M0_HALF's values computed, the float whose
   exponent field is e - 1, or for e < 2 the subnormal 2^-128 << e. */
static inline __m256 e8m0_half_ps(__m256i e) {
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

/* Eight MXFP4 blocks at once (b to b + 7 at blk: four pairs as pair_mxfp4 unpacks them) against T tokens' q8b
   blocks a and their octets' sums and scales o: each pair's products summed by fours into [4 partial sums of its
   first block | of its second], then the four pairs' partial sums added across the lanes in integers (vphaddd:
   exact) into one register of eight block sums, [b, b + 2, b + 4, b + 6 | b + 1, ...]; the activation's sums
   added, converted once and scaled by the eight blocks' scales (their exponents put together by unpacking four
   loads: a gather of them cost a fifth of the time at one token) times the token's (one load). pair_mxfp4
   converts and scales each pair's eight partial sums apart and builds a pair's sums and scales from scalars for
   every row and token. The blocks are one row's, read in place and in order (four rows at once, sharing the
   activation as llama.cpp's repacked block_mxfp4x8 does, read four streams in place and ran slower from memory).
   On a Zen 4, 256 rows in L2, one thread: one token 0.92 -> 0.76 ns a block (AVX2 library 1.08 -> 0.86), 4 tokens
   2.51 -> 1.69. */
INLINE void oct_mxfp4(const uint8_t *blk, const q8b *const *a, const q8b_oct *const *o, int T, __m256 *acc) {
    const __m256i low = _mm256_set1_epi8(0xF);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MXFP4_UNSIGNED));
    __m256i lo[4], hi[4];
    for (int j = 0; j < 4; j++) {
        const uint8_t *r = blk + 34 * j;
        const __m256i v = _mm256_loadu2_m128i((const __m128i *)(r + 17 + 1), (const __m128i *)(r + 1));
        lo[j] = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, low));                         /* weights 0-15 */
        hi[j] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));  /* 16-31 */
    }
    /* the blocks' exponents in the sums' order, [e0, e2, e4, e6, e1, e3, e5, e7]: each pair's two at bytes 0 and 17
       of a 32-byte load from its start (the same lines as its codes), interleaved by unpacking */
    const __m256i p01 = _mm256_unpacklo_epi8(_mm256_loadu_si256((const __m256i *)blk),
                                             _mm256_loadu_si256((const __m256i *)(blk + 34)));
    const __m256i p23 = _mm256_unpacklo_epi8(_mm256_loadu_si256((const __m256i *)(blk + 68)),
                                             _mm256_loadu_si256((const __m256i *)(blk + 102)));
    const __m256i es = _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi16(p01, p23),
                                                   _mm256_setr_epi32(0, 5, 0, 0, 0, 0, 0, 0));
    const __m256 dw = e8m0_half_ps(_mm256_cvtepu8_epi32(_mm256_castsi256_si128(es)));
    for (int t = 0; t < T; t++) {
        const q8b *x = a[t];
        __m256i p[4];
        for (int j = 0; j < 4; j++)
            p[j] = dot4x2(lo[j], _mm256_loadu_si256((const __m256i *)x[2 * j].qs), hi[j],
                          _mm256_loadu_si256((const __m256i *)x[2 * j + 1].qs));
        const __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
        const __m256i s = _mm256_add_epi32(sums, _mm256_loadu_si256((const __m256i *)o[t]->sum));
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(o[t]->d)), _mm256_cvtepi32_ps(s), acc[t]);
    }
}

/* One row's blocks against T tokens' activations. Made a function per type and per T (1 to GQ_MAX_TOKENS), the
   block kernel inlined: with T a constant the accumulators and the unpacked codes stay in registers — with T read
   at run time gcc kept acc[t] and accm[t] on the stack, a store and a load every block on one chain, and spilled
   the codes (a 2048 x 2048 matrix at one token on a Zen 4's two cores, hot: Q4_K 159 -> 122 us, Q6_K 79 -> 51,
   Q8_0 280 -> 166; the same sums, bit for bit). BLOCK(blk, a, acc, accm): the block kernel on block blk with the
   tokens' blocks a (MXFP4's rows: MXFP4_ROW_DOT, below). */
#define ROW_DOT(name, act_t, BLOCK, NT, TS)                                                                   \
    static void name(const uint8_t *w, long blocks, const char *act, long act_bytes, float *out) {            \
        enum { T = NT };                                                                                       \
        const long ts = TS; /* (the type's block bytes, a constant: the prefetches' loops unrolled) */        \
        __m256 acc[T];                                                                                         \
        __m128 accm[T];                                                                                        \
        const act_t *a[T];                                                                                     \
        for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps(), accm[t] = _mm_setzero_ps();                  \
        for (long b = 0; b < blocks; b++) {                                                                    \
            for (long off = 0; off < ts; off += 64) /* ahead of the hardware prefetcher, as q_int.c */          \
                _mm_prefetch((const char *)(w + b * ts + off + GQ_PREFETCH_AHEAD), _MM_HINT_T0);               \
            for (int t = 0; t < T; t++) a[t] = (const act_t *)(act + t * act_bytes) + b;                        \
            BLOCK(w + b * ts, a, acc, accm);                                                                   \
        }                                                                                                      \
        for (int t = 0; t < T; t++) out[t] = hsum_ps(acc[t]) - hsum_ps128(accm[t]);                            \
    }
/* MXFP4's rows: eight blocks at a time (oct_mxfp4), then pairs (pair_mxfp4) and an odd last block (blk_mxfp4);
   the octets' sums and scales after the row's q8b blocks. */
#define MXFP4_ROW_DOT(name, NT)                                                                               \
    static void name(const uint8_t *w, long blocks, const char *act, long act_bytes, float *out) {            \
        enum { T = NT };                                                                                       \
        __m256 acc[T];                                                                                         \
        const q8b *a[T];                                                                                       \
        const q8b_oct *o[T];                                                                                   \
        for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();                                              \
        long b = 0;                                                                                            \
        for (; b + 8 <= blocks; b += 8) {                                                                      \
            for (long off = 0; off < 8 * 17; off += 64)                                                        \
                _mm_prefetch((const char *)(w + b * 17 + off + GQ_PREFETCH_AHEAD), _MM_HINT_T0);               \
            for (int t = 0; t < T; t++)                                                                        \
                a[t] = (const q8b *)(act + t * act_bytes) + b, o[t] = (const q8b_oct *)(a[t] - b + blocks) + b / 8; \
            oct_mxfp4(w + b * 17, a, o, T, acc);                                                               \
        }                                                                                                      \
        for (; b < blocks; b += 2) { /* (at most seven blocks) */                                             \
            for (int t = 0; t < T; t++) a[t] = (const q8b *)(act + t * act_bytes) + b;                          \
            if (b + 2 <= blocks) pair_mxfp4(w + b * 17, a, T, acc);                                            \
            else blk_mxfp4(w + b * 17, a, T, acc);                                                             \
        }                                                                                                      \
        for (int t = 0; t < T; t++) out[t] = hsum_ps(acc[t]);                                                  \
    }
#define ROW_DOTS(name, act_t, BLOCK, TS)                                                                      \
    ROW_DOT(name##_1, act_t, BLOCK, 1, TS)                                                                     \
    ROW_DOT(name##_2, act_t, BLOCK, 2, TS)                                                                     \
    ROW_DOT(name##_3, act_t, BLOCK, 3, TS)                                                                     \
    ROW_DOT(name##_4, act_t, BLOCK, 4, TS)
#define Q8_0_BLOCK(blk, a, acc, accm) blk_q8_0(blk, a, T, acc)
#define Q4K_BLOCK(blk, a, acc, accm) blk_q45k(blk, a, T, acc, accm, 0)
#define Q5K_BLOCK(blk, a, acc, accm) blk_q45k(blk, a, T, acc, accm, 1)
#define Q6K_BLOCK(blk, a, acc, accm) blk_q6k(blk, a, T, acc)
#define Q4_0_BLOCK(blk, a, acc, accm) blk_legacy(blk, a, T, acc, accm, GQ_Q4_0)
#define Q4_1_BLOCK(blk, a, acc, accm) blk_legacy(blk, a, T, acc, accm, GQ_Q4_1)
#define Q5_0_BLOCK(blk, a, acc, accm) blk_legacy(blk, a, T, acc, accm, GQ_Q5_0)
#define Q5_1_BLOCK(blk, a, acc, accm) blk_legacy(blk, a, T, acc, accm, GQ_Q5_1)
ROW_DOTS(row_q8_0, q8b, Q8_0_BLOCK, 34)  /* (TYPE_SIZE's) */
ROW_DOTS(row_q4k, q8k, Q4K_BLOCK, 144)
ROW_DOTS(row_q5k, q8k, Q5K_BLOCK, 176)
ROW_DOTS(row_q6k, q8k, Q6K_BLOCK, 210)
ROW_DOTS(row_q4_0, q8b, Q4_0_BLOCK, 18)
ROW_DOTS(row_q4_1, q8b, Q4_1_BLOCK, 20)
ROW_DOTS(row_q5_0, q8b, Q5_0_BLOCK, 22)
ROW_DOTS(row_q5_1, q8b, Q5_1_BLOCK, 24)
MXFP4_ROW_DOT(row_mxfp4_1, 1)
MXFP4_ROW_DOT(row_mxfp4_2, 2)
MXFP4_ROW_DOT(row_mxfp4_3, 3)
MXFP4_ROW_DOT(row_mxfp4_4, 4)
#undef MXFP4_ROW_DOT
#undef ROW_DOTS
#undef ROW_DOT

typedef void (*row_fn)(const uint8_t *, long, const char *, long, float *);
#define BY_T(name) {name##_1, name##_2, name##_3, name##_4}
static const row_fn ROWS[GQ_TYPES][GQ_MAX_TOKENS] = {  /* [type][T - 1], types in GQ_* order */
    BY_T(row_q8_0), BY_T(row_q4k), BY_T(row_q5k), BY_T(row_q6k),
    BY_T(row_q4_0), BY_T(row_q4_1), BY_T(row_q5_0), BY_T(row_q5_1), BY_T(row_mxfp4),
};
#undef BY_T

int moetier_gq_fits(int type, long K) {
    return type >= GQ_Q8_0 && type < GQ_TYPES && K > 0 && K % BLOCK_SIZE[type] == 0;
}

/* y [T, N] fp32 = W [N, K] (`type` blocks, rows back to back) x the T activations `act` (moetier_gq_quantize_act's),
   T <= GQ_MAX_TOKENS. Rows in parallel where the matrix is big enough to pay for the threads. */
void moetier_gq_linear(int type, const uint8_t *w, long N, long K, const void *act, int T, float *y) {
    const long blocks = K / BLOCK_SIZE[type], ts = TYPE_SIZE[type], row_bytes = blocks * ts;
    const long act_bytes = moetier_gq_act_bytes(type, K);
    const row_fn row = ROWS[type][T - 1];
#pragma omp parallel for schedule(static) if (N * row_bytes >= GQ_PARALLEL_MIN_BYTES)
    for (long r = 0; r < N; r++) {
        float out[GQ_MAX_TOKENS];
        row(w + r * row_bytes, blocks, (const char *)act, act_bytes, out);
        for (int t = 0; t < T; t++) y[t * N + r] = out[t];
    }
}

/* yt [N, T] fp32 (y transposed: each row's outputs together) = W [N, K] x any number T of tokens' activations: a
   tile of rows (GQ_TILE_BYTES) against every pass of GQ_MAX_TOKENS tokens before the next tile, so each row comes
   from memory once for all of them (the tile stays in L1/L2 between passes) and a pass's activations stay in L1
   across the tile — llama.cpp's way with a prompt. Row by row instead (each row meeting all the tokens before the
   next), every row read all the tokens' activations from L2 (q_int.c measured that 1.2x slower at 128 tokens).
   For a bf16 prompt where torch's bf16 GEMM is slow or, below gemm_precision.integer_tokens, not worth the
   dequantization (moetier/model/gemm_precision.py). */
void moetier_gq_linear_tokens(int type, const uint8_t *w, long N, long K, const void *act, long T, float *yt) {
    const long blocks = K / BLOCK_SIZE[type], ts = TYPE_SIZE[type], row_bytes = blocks * ts;
    const long act_bytes = moetier_gq_act_bytes(type, K);
    const long tile = row_bytes >= GQ_TILE_BYTES ? 1 : GQ_TILE_BYTES / row_bytes;
#pragma omp parallel for schedule(static) if (N * row_bytes >= GQ_PARALLEL_MIN_BYTES)
    for (long r0 = 0; r0 < N; r0 += tile)
        for (long p = 0; p < T; p += GQ_MAX_TOKENS) {
            const int n = T - p < GQ_MAX_TOKENS ? (int)(T - p) : GQ_MAX_TOKENS;
            for (long r = r0; r < r0 + tile && r < N; r++)
                ROWS[type][n - 1](w + r * row_bytes, blocks, (const char *)act + p * act_bytes, act_bytes,
                                  yt + r * T + p);
        }
}

/* Bytes of scratch moetier_gq_swiglu needs: both matrices' activations, gate_up's and down's outputs, h. */
long moetier_gq_swiglu_scratch(int gu_type, int d_type, long H, long I, int T) {
    return T * (moetier_gq_act_bytes(gu_type, H) + moetier_gq_act_bytes(d_type, I)) + 4L * T * (2 * I + H + I + H)
           + 64;
}

/* One SwiGLU expert in block formats for any number T of bf16 rows x [T, H], as GgmlExpert computes it with
   torch's ops in bf16: g, u = bf16(gate_up . x); h = bf16(bf16(silu(g)) * u); out [T, H] = bf16(bf16(down . h) *
   weight[t]) — in one call, so an expert costs its two matrices and not a dozen small torch ops. More tokens than a
   pass: each row read once for all of them (moetier_gq_linear_tokens, its outputs [N, T]), bit for bit the same
   values; the elementwise steps between then split across the threads. */
void moetier_gq_swiglu(int gu_type, const uint8_t *w_gu, int d_type, const uint8_t *w_d, long H, long I,
                       const uint16_t *x, int T, const uint16_t *weights, uint16_t *out, void *scratch) {
    char *p = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *xf = (float *)p, *gu = xf + T * H, *hf = gu + T * 2 * I, *y = hf + T * I;
    char *act_gu = (char *)(y + T * H), *act_d = act_gu + T * moetier_gq_act_bytes(gu_type, H);
    const int passes = T > GQ_MAX_TOKENS; /* outputs [N, T] (moetier_gq_linear_tokens), else [T, N] */
    const long gu_t = passes ? 1 : 2 * I, gu_r = passes ? T : 1, y_t = passes ? 1 : H, y_r = passes ? T : 1;
    for (long i = 0; i < T * H; i++) xf[i] = bf16_to_f32(x[i]);
    moetier_gq_quantize_act(gu_type, xf, H, T, act_gu);
    if (passes) moetier_gq_linear_tokens(gu_type, w_gu, 2 * I, H, act_gu, T, gu);
    else moetier_gq_linear(gu_type, w_gu, 2 * I, H, act_gu, T, gu);
#pragma omp parallel for schedule(static) if (passes)
    for (int t = 0; t < T; t++)
        for (long i = 0; i < I; i++) {
            const float g = round_bf16(gu[t * gu_t + i * gu_r]), u = round_bf16(gu[t * gu_t + (I + i) * gu_r]);
            hf[t * I + i] = swiglu_bf16(g, u);
        }
    moetier_gq_quantize_act(d_type, hf, I, T, act_d);
    if (passes) moetier_gq_linear_tokens(d_type, w_d, H, I, act_d, T, y);
    else moetier_gq_linear(d_type, w_d, H, I, act_d, T, y);
#pragma omp parallel for schedule(static) if (passes)
    for (int t = 0; t < T; t++) {
        const float w = bf16_to_f32(weights[t]);
        for (long h = 0; h < H; h++) out[t * H + h] = f32_to_bf16(round_bf16(y[t * y_t + h * y_r]) * w);
    }
}

/* Bytes of one activation over K inputs for the type that needs the most (q8b: Q8_0's, the legacy formats',
   MXFP4's). */
static long act_most(long K) {
    long most = 0;
    for (int type = 0; type < GQ_TYPES; type++)
        if (K % BLOCK_SIZE[type] == 0 && moetier_gq_act_bytes(type, K) > most) most = moetier_gq_act_bytes(type, K);
    return most;
}

static long round64(long bytes) { return (bytes + 63) & ~63L; }

/* The bytes of n SwiGLU experts' blocks (gate_up [2I, H] of gu_type[e], down [H, I] of d_type[e]): whether a call
   pays for the threads. */
static long experts_bytes(long n, const int *gu_type, const int *d_type, long H, long I) {
    long bytes = 0;
    for (long e = 0; e < n; e++)
        bytes += 2 * I * (H / BLOCK_SIZE[gu_type[e]]) * TYPE_SIZE[gu_type[e]]
                 + H * (I / BLOCK_SIZE[d_type[e]]) * TYPE_SIZE[d_type[e]];
    return bytes;
}

/* The activation between an expert's two matrices in the calls below: SwiGLU (no biases), or gpt-oss's clamped
   SwiGLU with its biases — what GgmlClampedExpert's torch ops compute, rounded where they round in bf16: g and u
   the fp32 products plus their fp32 biases, rounded; g clamped from above, u both ways, at `limit`;
   h = bf16(bf16(u + 1) * bf16(g * bf16(sigmoid(bf16(g * alpha))))); down's output plus its bias, rounded. */
typedef struct {
    const float *const *gu_bias, *const *d_bias; /* NULL: SwiGLU; else expert e's [2I] and [H] */
    float alpha, limit;
} gq_glu;

static const gq_glu SWIGLU = {NULL, NULL, 0.0f, 0.0f};

/* h's value of expert e's hidden unit r from gate_up's fp32 outputs g (row r) and u (row I + r). */
static inline float glu_h(const gq_glu *act, long e, long r, long I, float g, float u) {
    if (!act->gu_bias) return swiglu_bf16(round_bf16(g), round_bf16(u));
    g = fminf(round_bf16(g + act->gu_bias[e][r]), act->limit);
    u = fminf(fmaxf(round_bf16(u + act->gu_bias[e][I + r]), -act->limit), act->limit);
    const float s = round_bf16(1.0f / (1.0f + expf(-round_bf16(g * act->alpha))));
    return round_bf16(round_bf16(u + 1.0f) * round_bf16(g * s));
}

/* Expert e's output k from down's fp32 output o, before its routing weight: rounded to bf16 (its bias added first). */
static inline float glu_out(const gq_glu *act, long e, long k, float o) {
    return round_bf16(act->d_bias ? o + act->d_bias[e][k] : o);
}

/* Bytes of scratch moetier_gq_swiglu_token (and so moetier_gq_swiglu_token_routed) needs for n experts. */
long moetier_gq_token_scratch(long n, long H, long I) {
    return 64 + round64(4 * H) + n * round64(act_most(H)) + n * round64(act_most(I)) + round64(4 * n * I)
           + round64(4 * n * H);
}

/* One token through n experts in block formats (expert e: gate_up_proj gu[e] of type gu_type[e], down_proj d[e] of
   d_type[e]), their outputs summed: out [H] = sum over e in order, in fp32, of bf16(bf16(down_e . h_e) * weight[e])
   with h_e = bf16(bf16(silu(g)) * u), g and u = bf16(gate_up_e . x) — bit for bit moetier_gq_swiglu on each expert
   (weight[e] a bf16 value) followed by moetier_sum_rows_bf16. Why one call: that was two parallel regions an expert
   with the SwiGLU, the activation's quantization and the conversions between them on one core while the others
   waited; here one region, x quantized once per type, each expert's h quantized in parallel.
   scratch: moetier_gq_token_scratch bytes. */
static void gq_token(const gq_glu *act, long n, const int *gu_type, const uint8_t *const *gu, const int *d_type,
                     const uint8_t *const *d, const uint16_t *x, const float *weight, uint16_t *out, long H, long I,
                     char *scratch) {
    const long x_bytes = round64(act_most(H)), h_bytes = round64(act_most(I)); /* (as the scratch was sized) */
    char *p = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *xf = (float *)p;
    p += round64(4 * H);
    const char *xa[n]; /* x quantized for expert e's gate_up (once per type) */
    char *ha[n];       /* h_e quantized for its down_proj */
    for (long e = 0; e < n; e++, p += h_bytes) ha[e] = p;
    for (long i = 0; i < H; i++) xf[i] = bf16_to_f32(x[i]);
    for (long e = 0; e < n; e++) {
        long same = 0;
        while (same < e && gu_type[same] != gu_type[e]) same++;
        if (same < e) {
            xa[e] = xa[same];
        } else {
            moetier_gq_quantize_act(gu_type[e], xf, H, 1, p);
            xa[e] = p, p += x_bytes;
        }
    }
    float *h = (float *)p, *ys = h + n * I; /* [n, I], [n, H]: ys as moetier_gq_swiglu rounds each output */
    const long bytes = experts_bytes(n, gu_type, d_type, H, I);
#pragma omp parallel if (bytes >= GQ_PARALLEL_MIN_BYTES)
    {
#pragma omp for schedule(static)
        for (long item = 0; item < n * I; item++) { /* gate row r and up row I + r together: h's value at once */
            const long e = item / I, r = item - e * I, ts = TYPE_SIZE[gu_type[e]], blocks = H / BLOCK_SIZE[gu_type[e]];
            const row_fn row = ROWS[gu_type[e]][0];
            float g, u;
            row(gu[e] + r * blocks * ts, blocks, xa[e], 0, &g);
            row(gu[e] + (I + r) * blocks * ts, blocks, xa[e], 0, &u);
            h[e * I + r] = glu_h(act, e, r, I, g, u);
        } /* barrier: every h is written before it is quantized */
#pragma omp for schedule(static)
        for (long e = 0; e < n; e++) moetier_gq_quantize_act(d_type[e], h + e * I, I, 1, ha[e]);
#pragma omp for schedule(static)
        for (long item = 0; item < n * H; item++) {
            const long e = item / H, k = item - e * H, ts = TYPE_SIZE[d_type[e]], blocks = I / BLOCK_SIZE[d_type[e]];
            float o;
            ROWS[d_type[e]][0](d[e] + k * blocks * ts, blocks, ha[e], 0, &o);
            ys[e * H + k] = round_bf16(glu_out(act, e, k, o) * weight[e]);
        } /* barrier: every expert's output is made before they are summed */
#pragma omp for schedule(static)
        for (long k = 0; k < H; k++) out[k] = f32_to_bf16(sum_column(ys, n, H, k));
    }
}

void moetier_gq_swiglu_token(long n, const int *gu_type, const uint8_t *const *gu, const int *d_type,
                             const uint8_t *const *d, const uint16_t *x, const float *weight, uint16_t *out, long H,
                             long I, char *scratch) {
    gq_token(&SWIGLU, n, gu_type, gu, d_type, d, x, weight, out, H, I, scratch);
}

/* As moetier_gq_swiglu_token for gpt-oss's experts (gq_glu): gu_bias[e] [2I] and d_bias[e] [H] fp32. */
void moetier_gq_glu_token(long n, const int *gu_type, const uint8_t *const *gu, const int *d_type,
                          const uint8_t *const *d, const float *const *gu_bias, const float *const *d_bias,
                          float alpha, float limit, const uint16_t *x, const float *weight, uint16_t *out, long H,
                          long I, char *scratch) {
    const gq_glu act = {gu_bias, d_bias, alpha, limit};
    gq_token(&act, n, gu_type, gu, d_type, d, x, weight, out, H, I, scratch);
}

/* Bytes of scratch moetier_gq_swiglu_layer needs for P (token, expert) pairs. */
long moetier_gq_layer_scratch(long P, long H, long I) {
    return 64 + P * (round64(act_most(H)) + round64(act_most(I))) + round64(4 * P * I);
}

/* A layer's n experts in block formats in one call (expert e: gate_up_proj gu[e] of type gu_type[e], down_proj d[e]
   of d_type[e]), each on its rows span[2e] <= p < span[2e + 1] of xs [P, H] bf16 — at most GQ_MAX_TOKENS of them —
   writing those rows of ys [P, H]: bit for bit what moetier_gq_swiglu computes for each expert alone (weights [P]
   bf16, each pair's routing weight); rows no expert takes are neither read nor written.
   Why: a decode step of a batch (a server's sequences) or a short prompt gives each of a layer's experts a token or
   a few, and one call an expert was a parallel region and a trip through Python each (a 2-sequence step of a Q4_K_M
   OLMoE: ~16 a layer); here one region, as moetier_swiglu_qi_layer does for the int codes: every pair's row
   quantized (split across the threads), all experts' gate and up rows as one list of work, one barrier, the h rows
   quantized, all down rows. scratch: moetier_gq_layer_scratch bytes. */
static void gq_layer(const gq_glu *act, long n, const int *gu_type, const uint8_t *const *gu, const int *d_type,
                     const uint8_t *const *d, const long *span, long P, const uint16_t *xs, const uint16_t *weights,
                     uint16_t *ys, long H, long I, char *scratch) {
    const long x_bytes = round64(act_most(H)), h_bytes = round64(act_most(I)); /* a pair's activations' stride */
    char *xa = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63), *ha = xa + P * x_bytes;
    float *h = (float *)(ha + P * h_bytes); /* [P, I] */
    const long bytes = experts_bytes(n, gu_type, d_type, H, I);
#pragma omp parallel if (bytes >= GQ_PARALLEL_MIN_BYTES)
    {
#pragma omp for schedule(static)
        for (long e = 0; e < n; e++)
            for (long t = span[2 * e]; t < span[2 * e + 1]; t++) {
                float xf[H];
                for (long k = 0; k < H; k++) xf[k] = bf16_to_f32(xs[t * H + k]);
                moetier_gq_quantize_act(gu_type[e], xf, H, 1, xa + t * x_bytes);
            }
#pragma omp for schedule(static)
        for (long item = 0; item < n * I; item++) { /* gate row r and up row I + r together: h's values at once */
            const long e = item / I, r = item - e * I, a = span[2 * e], T = span[2 * e + 1] - a;
            if (T <= 0) continue;
            const long ts = TYPE_SIZE[gu_type[e]], blocks = H / BLOCK_SIZE[gu_type[e]];
            const row_fn row = ROWS[gu_type[e]][T - 1];
            float g[GQ_MAX_TOKENS], u[GQ_MAX_TOKENS];
            row(gu[e] + r * blocks * ts, blocks, xa + a * x_bytes, x_bytes, g);
            row(gu[e] + (I + r) * blocks * ts, blocks, xa + a * x_bytes, x_bytes, u);
            for (long t = 0; t < T; t++) h[(a + t) * I + r] = glu_h(act, e, r, I, g[t], u[t]);
        } /* barrier: every h is written before it is quantized */
#pragma omp for schedule(static)
        for (long e = 0; e < n; e++)
            for (long t = span[2 * e]; t < span[2 * e + 1]; t++)
                moetier_gq_quantize_act(d_type[e], h + t * I, I, 1, ha + t * h_bytes);
#pragma omp for schedule(static)
        for (long item = 0; item < n * H; item++) {
            const long e = item / H, k = item - e * H, a = span[2 * e], T = span[2 * e + 1] - a;
            if (T <= 0) continue;
            const long ts = TYPE_SIZE[d_type[e]], blocks = I / BLOCK_SIZE[d_type[e]];
            float o[GQ_MAX_TOKENS];
            ROWS[d_type[e]][T - 1](d[e] + k * blocks * ts, blocks, ha + a * h_bytes, h_bytes, o);
            for (long t = 0; t < T; t++)
                ys[(a + t) * H + k] = f32_to_bf16(glu_out(act, e, k, o[t]) * bf16_to_f32(weights[a + t]));
        }
    }
}

void moetier_gq_swiglu_layer(long n, const int *gu_type, const uint8_t *const *gu, const int *d_type,
                             const uint8_t *const *d, const long *span, long P, const uint16_t *xs,
                             const uint16_t *weights, uint16_t *ys, long H, long I, char *scratch) {
    gq_layer(&SWIGLU, n, gu_type, gu, d_type, d, span, P, xs, weights, ys, H, I, scratch);
}

/* As moetier_gq_swiglu_layer for gpt-oss's experts (gq_glu): gu_bias[e] [2I] and d_bias[e] [H] fp32. */
void moetier_gq_glu_layer(long n, const int *gu_type, const uint8_t *const *gu, const int *d_type,
                          const uint8_t *const *d, const float *const *gu_bias, const float *const *d_bias,
                          float alpha, float limit, const long *span, long P, const uint16_t *xs,
                          const uint16_t *weights, uint16_t *ys, long H, long I, char *scratch) {
    const gq_glu act = {gu_bias, d_bias, alpha, limit};
    gq_layer(&act, n, gu_type, gu, d_type, d, span, P, xs, weights, ys, H, I, scratch);
}

/* Dequantization, as ggml's dequantize_row_* (and moetier/quant/ggml_blocks.py, bit for bit: no fused
   multiply-adds, the products in ggml's order), for a prefill's products through a float GEMM: W [N, K] in `type`
   -> out [N, K] fp32 or bf16 (each value rounded by f32_to_bf16's rule), rows in parallel. The k-quant files' types
   eight values at a time (written one value at a time, a Q6_K matrix took 3x a 16-token GEMM of it): each value the
   same product (and difference) of the same fp32 factors, rounded alike (tests/model/test_ggml_linear.py). */

static void scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) { /* ggml's get_scale_min_k4 */
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static inline __m256 int8x8_ps(const uint8_t *q) { /* eight int8 -> fp32 */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

static inline __m256i uint8x8_epi32(const uint8_t *q) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
}

/* Sixteen values, a's eight then b's, at element `at` of o: fp32 [..] or bf16 [..] (`fp32` is a constant where the
   functions below are inlined, so each output keeps one loop). */
static inline NO_FMA void store16(void *o, long at, __m256 a, __m256 b, const int fp32) {
    if (fp32) {
        _mm256_storeu_ps((float *)o + at, a);
        _mm256_storeu_ps((float *)o + at + 8, b);
    } else {
        _mm256_storeu_si256((__m256i *)((uint16_t *)o + at), bf16x16_of(a, b));
    }
}

static inline NO_FMA void deq_q8_0(const uint8_t *b, void *o, const int fp32) {
    const __m256 d = _mm256_set1_ps(f16_to_f32(b));
    for (int l = 0; l < 32; l += 16)
        store16(o, l, _mm256_mul_ps(d, int8x8_ps(b + 2 + l)), _mm256_mul_ps(d, int8x8_ps(b + 10 + l)), fp32);
}

static inline NO_FMA void deq_q45k(const uint8_t *b, void *o, const int five, const int fp32) {
    const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + (five ? 48 : 16);
    const __m256i low = _mm256_set1_epi32(0xF), one = _mm256_set1_epi32(1);
    for (int j = 0; j < 4; j++, ql += 32) {
        uint8_t sc, m;
        scale_min(2 * j, scales, &sc, &m);
        const __m256 d1 = _mm256_set1_ps(d * sc), m1 = _mm256_set1_ps(dmin * m);
        scale_min(2 * j + 1, scales, &sc, &m);
        const __m256 d2 = _mm256_set1_ps(d * sc), m2 = _mm256_set1_ps(dmin * m);
        const __m128i s1 = _mm_cvtsi32_si128(2 * j), s2 = _mm_cvtsi32_si128(2 * j + 1); /* qh's bits u1, u2 */
        for (int l = 0; l < 32; l += 16) {
            __m256 y1[2], y2[2];
            for (int s = 0; s < 2; s++) {
                const __m256i q = uint8x8_epi32(ql + l + 8 * s);
                __m256i q1 = _mm256_and_si256(q, low), q2 = _mm256_srli_epi32(q, 4);
                if (five) {
                    const __m256i h = uint8x8_epi32(qh + l + 8 * s);
                    q1 = _mm256_add_epi32(q1, _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, s1), one), 4));
                    q2 = _mm256_add_epi32(q2, _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, s2), one), 4));
                }
                y1[s] = _mm256_sub_ps(_mm256_mul_ps(d1, _mm256_cvtepi32_ps(q1)), m1);
                y2[s] = _mm256_sub_ps(_mm256_mul_ps(d2, _mm256_cvtepi32_ps(q2)), m2);
            }
            store16(o, 64 * j + l, y1[0], y1[1], fp32);
            store16(o, 64 * j + 32 + l, y2[0], y2[1], fp32);
        }
    }
}

static inline NO_FMA void deq_q6k(const uint8_t *b, void *o, const int fp32) {
    const float d = f16_to_f32(b + 208);
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const __m256i low = _mm256_set1_epi32(0xF), three = _mm256_set1_epi32(3), mid = _mm256_set1_epi32(32);
    for (int n = 0; n < QK; n += 128, ql += 64, qh += 32, sc += 8) {
        for (int l = 0; l < 32; l += 16) {
            const int is = l / 16;
            /* (d * sc) * q, as ggml's d * sc[is] * q1 associates */
            const __m256 d1 = _mm256_set1_ps(d * (float)sc[is]), d2 = _mm256_set1_ps(d * (float)sc[is + 2]),
                         d3 = _mm256_set1_ps(d * (float)sc[is + 4]), d4 = _mm256_set1_ps(d * (float)sc[is + 6]);
            __m256 y[4][2];
            for (int s = 0; s < 2; s++) {
                const long j = l + 8 * s;
                const __m256i a = uint8x8_epi32(ql + j), c = uint8x8_epi32(ql + j + 32), h = uint8x8_epi32(qh + j);
                const __m256i q1 = _mm256_or_si256(_mm256_and_si256(a, low),
                                                   _mm256_slli_epi32(_mm256_and_si256(h, three), 4));
                const __m256i q2 = _mm256_or_si256(
                    _mm256_and_si256(c, low), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2), three), 4));
                const __m256i q3 = _mm256_or_si256(
                    _mm256_srli_epi32(a, 4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 4), three), 4));
                const __m256i q4 = _mm256_or_si256(_mm256_srli_epi32(c, 4),
                                                   _mm256_slli_epi32(_mm256_srli_epi32(h, 6), 4));
                y[0][s] = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_sub_epi32(q1, mid)));
                y[1][s] = _mm256_mul_ps(d2, _mm256_cvtepi32_ps(_mm256_sub_epi32(q2, mid)));
                y[2][s] = _mm256_mul_ps(d3, _mm256_cvtepi32_ps(_mm256_sub_epi32(q3, mid)));
                y[3][s] = _mm256_mul_ps(d4, _mm256_cvtepi32_ps(_mm256_sub_epi32(q4, mid)));
            }
            for (int k = 0; k < 4; k++) store16(o, n + l + 32 * k, y[k][0], y[k][1], fp32);
        }
    }
}

static NO_FMA void deq_legacy(const uint8_t *b, float *y, const int type) { /* a legacy block, one value at a time */
    const int has_m = type == GQ_Q4_1 || type == GQ_Q5_1, five = type == GQ_Q5_0 || type == GQ_Q5_1;
    const uint8_t *qh = b + (has_m ? 4 : 2), *qs = qh + (five ? 4 : 0);
    uint32_t h = 0;
    if (five) memcpy(&h, qh, 4);
    const int off = type == GQ_Q4_0 ? 8 : type == GQ_Q5_0 ? 16 : 0;
    const float d = f16_to_f32(b), m = has_m ? f16_to_f32(b + 2) : 0.0f;
    for (int j = 0; j < 16; j++) {
        const int q0 = (qs[j] & 0xF) | (int)(((h >> j) & 1) << 4), q1 = (qs[j] >> 4) | (int)(((h >> (j + 16)) & 1) << 4);
        if (has_m) {
            y[j] = d * (float)q0 + m, y[j + 16] = d * (float)q1 + m;
        } else {
            y[j] = d * (float)(q0 - off), y[j + 16] = d * (float)(q1 - off);
        }
    }
}

/* As ggml's dequantize_row_mxfp4, eight values at a time: the codes looked up as their doubled values (int8), each
   times 2^(e - 128) — exact products, so fp32 or their bf16 rounding as torch's (a prefill's busy experts: one value
   at a time this took ~5 ms a gpt-oss-20b gate_up, half of a 128-token prompt's time). */
static inline NO_FMA void deq_mxfp4(const uint8_t *b, void *o, const int fp32) {
    const __m256 d = _mm256_set1_ps(E8M0_HALF[b[0]]);
    const __m128i v = _mm_loadu_si128((const __m128i *)(b + 1)), low = _mm_set1_epi8(0xF);
    const __m128i lut = _mm_loadu_si128((const __m128i *)MXFP4_VALUES);
    const __m128i q[2] = {_mm_shuffle_epi8(lut, _mm_and_si128(v, low)),  /* weights 0-15 */
                          _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(v, 4), low))};  /* 16-31 */
    for (int h = 0; h < 2; h++) {
        const __m256 a = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q[h])));
        const __m256 c = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q[h], 8))));
        store16(o, 16 * h, a, c, fp32);
    }
}

/* One row of `blocks` blocks of `type` -> fp32 or bf16 values; the legacy types (a Q4_K_M file's rows that are not
   whole 256-blocks) through a block of fp32. */
static inline NO_FMA void deq_row(int type, const uint8_t *w, long blocks, void *o, const int fp32) {
    const long ts = TYPE_SIZE[type], bs = BLOCK_SIZE[type];
    for (long b = 0, at = 0; b < blocks; b++, w += ts, at += bs) {
        void *ob = fp32 ? (void *)((float *)o + at) : (void *)((uint16_t *)o + at);
        switch (type) {
            case GQ_Q8_0: deq_q8_0(w, ob, fp32); break;
            case GQ_Q4_K: deq_q45k(w, ob, 0, fp32); break;
            case GQ_Q5_K: deq_q45k(w, ob, 1, fp32); break;
            case GQ_Q6_K: deq_q6k(w, ob, fp32); break;
            case GQ_MXFP4: deq_mxfp4(w, ob, fp32); break;
            default: {
                float y[32];
                deq_legacy(w, y, type);
                for (long j = 0; j < bs; j++) {
                    if (fp32) ((float *)ob)[j] = y[j];
                    else ((uint16_t *)ob)[j] = f32_to_bf16(y[j]);
                }
            }
        }
    }
}

void moetier_gq_dequantize(int type, const uint8_t *w, long N, long K, float *out) {
    const long blocks = K / BLOCK_SIZE[type], ts = TYPE_SIZE[type];
#pragma omp parallel for schedule(static) if (N * blocks * ts >= GQ_PARALLEL_MIN_BYTES)
    for (long r = 0; r < N; r++) deq_row(type, w + r * blocks * ts, blocks, out + r * K, 1);
}

/* As moetier_gq_dequantize, each value rounded to bf16 (out [N, K] bf16): a prefill's matrix for torch's bf16 GEMM
   (where the CPU has bf16 dot products: moetier/model/gemm_precision.py), written at half the bytes. */
void moetier_gq_dequantize_bf16(int type, const uint8_t *w, long N, long K, uint16_t *out) {
    const long blocks = K / BLOCK_SIZE[type], ts = TYPE_SIZE[type];
#pragma omp parallel for schedule(static) if (N * blocks * ts >= GQ_PARALLEL_MIN_BYTES)
    for (long r = 0; r < N; r++) deq_row(type, w + r * blocks * ts, blocks, out + r * K, 0);
}
