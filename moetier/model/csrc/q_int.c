/* Quantized experts by integer dot products, as llama.cpp computes its quantized matrices: each token's
   activation row is quantized to int8 in blocks (128 inputs where a block is an int4 weight group or a stretch of
   an int8 row, as llama.cpp's k-quants take 256 (Q8_K); otherwise 32, its Q8_0 block), and each row's codes meet
   it in uint8 x int8 multiply-adds into int32 — AVX-512 VNNI's vpdpbusd (64 products an instruction) where the CPU
   has it, AVX2's vpmaddubsw + vpmaddwd otherwise. The codes stay as the store holds them
   (moetier/quant/codes.py): nothing is repacked at load.

   Why: unpacking codes to floats (q_rows.c) made int4 compute-bound at ~10 GB/s of codes, slower per weight than
   bf16 streams from memory; here a 64-byte load of int4 codes is one and, one shift and two vpdpbusd, so the
   codes stream at the memory's speed and a quantized expert costs in proportion to its bytes.

   Arithmetic, per row r and token t: y = sum_b s_g(b) * dx_b * I_b + sum_g (z_g * A_g - mid * s_g * B_g), where
   for block b (moetier_qi_block's inputs) I_b = sum of q * xq (exact, int32), xq = round(x / dx_b),
   dx_b = max|x| / 127 over the block; for weight group g (128 inputs for int4, 64 for int2) A_g = sum of x (fp32) and B_g = sum over
   its blocks of dx_b * sum of xq. int8 (w = q * s, one s a row): the AVX-512 path feeds q + 128 as the unsigned
   operand (vpdpbusd multiplies unsigned by signed) and takes 128 * s * sum_b dx_b * sum of xq off; the AVX2 path
   multiplies |xq| by q with xq's sign (no int16 overflow in vpmaddubsw), needing no correction. Against the
   dequantized weights (the reference) the difference is the activations' rounding to int8: measured on a random
   2048x1024 expert ~1% of the output's mean size with blocks of 32 (2.3% with 128) — beside int4's own 18% from
   the weights, and measured on text by `moetier eval`. Outputs are rounded to bf16 where torch's ops round.
   Blocks of 128 let a block's chunks add up in int32 and meet their scales once (qi_row_blocks): with blocks of
   32 every chunk needed its own conversion, multiply and fma, and int4 ran at ~9 GB/s of codes a core here
   (Zen 3, AVX2) against ~15 with blocks of 128.

   Layout of a token's quantized activation for one matrix: the row's code bytes are cut into chunks of W bytes
   (the vector width: 64 on AVX-512, 32 on AVX2); a chunk's codes hold W * S inputs (S = 8 / bits per byte), and
   the activation is stored per chunk as S streams of W values — stream s holding the inputs that sit in bits
   s * bits of each byte — so each unpacked code vector meets a contiguous activation vector. A last, shorter
   chunk of L < W bytes is laid out the same way with streams of L values and computed by scalar code. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define QI_MAX_TOKENS 4
#define QI_PARALLEL_MIN_BYTES (128 * 1024)
#define QI_TILE_BYTES (16 * 1024) /* codes a tile of rows holds (tile_rows) */
#define QI_BLOCK 32      /* inputs per activation scale, at least (and the unit codes are arranged in) */
#define QI_BIG_BLOCK 128 /* ...and at most: llama.cpp's k-quants take 256 (Q8_K) */
#define QI_PREFETCH_AHEAD 2048 /* bytes of codes (two int4 rows of 2048): a compute-heavy loop runs ahead of the
                                  hardware prefetcher; an int4 expert from memory 0.20-0.22 -> 0.18-0.19 ms
                                  against 512 (Zen 3; 3 KiB no better) */

/* P bf16 values (P = 1, 2, 4 or 8; exactly those bytes read) as floats in the low lanes. */
static inline __m256 load_bf16(const uint16_t *p, int P) {
    __m128i v = P == 8   ? _mm_loadu_si128((const __m128i *)p)
                : P == 4 ? _mm_loadl_epi64((const __m128i *)p)
                : P == 2 ? _mm_cvtsi32_si128(*(const int32_t *)p)
                         : _mm_cvtsi32_si128(*p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define W 64
#define INT8_BIAS 128
typedef __m512i vi;
typedef __m512 vf;
static inline vi loadv(const void *p) { return _mm512_loadu_si512(p); }
static inline vi zerov(void) { return _mm512_setzero_si512(); }
static inline vi maskv(vi v, int bits) { return _mm512_and_si512(v, _mm512_set1_epi8((char)((1 << bits) - 1))); }
static inline vi shiftv(vi v, int n) { return _mm512_srli_epi16(v, n); }
static inline vi dpu(vi acc, vi u, vi x) { return _mm512_dpbusd_epi32(acc, u, x); }
/* A chunk of packed codes (S streams of `bits` bits a byte) against its S activation vectors at x. */
static inline vi dp_streams(vi codes, const int8_t *x, int bits, int S) {
    vi acc = dpu(zerov(), maskv(codes, bits), loadv(x));
    for (int s = 1; s < S; s++) acc = dpu(acc, maskv(shiftv(codes, s * bits), bits), loadv(x + s * W));
    return acc;
}
static inline vi dp8(vi acc, vi codes, vi x) { /* int8 codes: (q + 128) as unsigned, times xq */
    return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(codes, _mm512_set1_epi8((char)0x80)), x);
}
static inline vf zerof(void) { return _mm512_setzero_ps(); }
static inline vf loadf(const float *p) { return _mm512_loadu_ps(p); }
static inline vf cvtmul(vi acc, vf scale) { return _mm512_mul_ps(_mm512_cvtepi32_ps(acc), scale); }
static inline vf _cvt(vi acc) { return _mm512_cvtepi32_ps(acc); }
static inline vi _add32(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vf addf(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf fmaf_v(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float hsumf(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf bcast(float s) { return _mm512_set1_ps(s); }
/* Floats v[0..P) (P = 2, 4 or 8) each spread over 16 / P lanes. */
static inline vf spread(__m256 v, int P) {
    __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_permutexvar_ps(_mm512_srli_epi32(lane, P == 2 ? 3 : P == 4 ? 2 : 1), _mm512_castps256_ps512(v));
}
#define QI_ISA "avx512-vnni"
#else
#define W 32
#define INT8_BIAS 0
typedef __m256i vi;
typedef __m256 vf;
static inline vi loadv(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi zerov(void) { return _mm256_setzero_si256(); }
static inline vi maskv(vi v, int bits) { return _mm256_and_si256(v, _mm256_set1_epi8((char)((1 << bits) - 1))); }
static inline vi shiftv(vi v, int n) { return _mm256_srli_epi16(v, n); }
#if defined(__AVXVNNI__)
/* AVX-VNNI (Intel's cores from Alder Lake on: 256-bit vpdpbusd without AVX-512): the products summed by fours
   into int32 in one instruction. The AVX2 sequence below never saturates its int16 pairs (see each use), so both
   make the same integer sums: this library's outputs are the AVX2 library's, bit for bit. */
static inline vi dpu(vi acc, vi u, vi x) { return _mm256_dpbusd_avx_epi32(acc, u, x); }
#else
static inline vi dpu(vi acc, vi u, vi x) { /* codes <= 15 times |x| <= 127, in pairs: no int16 overflow */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}
#endif
static inline vi dp8(vi acc, vi codes, vi x) { /* |xq| times q with xq's sign: pairs of at most 127 * 127 */
    return dpu(acc, _mm256_abs_epi8(x), _mm256_sign_epi8(codes, x));
}
/* A chunk of packed codes (S streams of `bits` bits a byte) against its S activation vectors at x. The streams'
   pair sums are added in int16 before one widening vpmaddwd (codes <= 15: S pairs of at most 15 * 127 * 2, 7,620
   for int4's two, 3,048 for int2's four, far from 32,767): vpmaddubsw and vpmaddwd share one port here (measured
   ~1 a cycle), so one widening a chunk instead of S is most of the integer work saved. */
static inline vi dp_streams(vi codes, const int8_t *x, int bits, int S) {
#if defined(__AVXVNNI__) /* (one instruction a stream: nothing left to save by summing in int16 first) */
    vi acc = dpu(zerov(), maskv(codes, bits), loadv(x));
    for (int s = 1; s < S; s++) acc = dpu(acc, maskv(shiftv(codes, s * bits), bits), loadv(x + s * W));
    return acc;
#else
    __m256i s16 = _mm256_maddubs_epi16(maskv(codes, bits), loadv(x));
    for (int s = 1; s < S; s++)
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(maskv(shiftv(codes, s * bits), bits), loadv(x + s * W)));
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
}
static inline vf zerof(void) { return _mm256_setzero_ps(); }
static inline vf loadf(const float *p) { return _mm256_loadu_ps(p); }
static inline vf cvtmul(vi acc, vf scale) { return _mm256_mul_ps(_mm256_cvtepi32_ps(acc), scale); }
static inline vf _cvt(vi acc) { return _mm256_cvtepi32_ps(acc); }
static inline vi _add32(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vf addf(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf fmaf_v(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float hsumf(vf v) { return hsum(v); }
static inline vf bcast(float s) { return _mm256_set1_ps(s); }
static inline vf spread(__m256 v, int P) { /* P = 2, 4 or 8 */
    return _mm256_permutevar8x32_ps(v, P == 2   ? _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)
                                       : P == 4 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)
                                                : _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#if defined(__AVXVNNI__)
#define QI_ISA "avx2-vnni"
#else
#define QI_ISA "avx2"
#endif
#endif

/* A block's sums over its chunks' streams, for int4 and int2 (qi_rowsn_blocks). AVX2: kept in int16 until the block
   ends, one widening vpmaddwd a block instead of one a chunk. A block holds QI_BIG_BLOCK inputs at most, W of them a
   vpmaddubsw, each of whose pair sums is at most 2 * 15 * 127 for int4 (2 * 3 * 127 for int2): int4's four add to
   15,240, far from 32,767 (int8's single products reach 32,258: int8 keeps dp8). Integer sums either way, so the
   outputs are the same bits. VNNI (AVX-512, AVX-VNNI): vpdpbusd into the int32 lanes as it goes. */
#if W == 32 && !defined(__AVXVNNI__)
_Static_assert(QI_BIG_BLOCK / W * 2 * 15 * 127 <= 32767, "an int4 block's int16 sums could overflow");
typedef __m256i vb; /* int16 */
static inline vb blk_zero(void) { return _mm256_setzero_si256(); }
static inline vb blk_streams(vb acc, vi codes, const int8_t *x, int bits, int S) {
    for (int s = 0; s < S; s++)
        acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(maskv(s ? shiftv(codes, s * bits) : codes, bits),
                                                         loadv(x + s * W)));
    return acc;
}
static inline vi blk_widen(vb acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
#else
typedef vi vb;
static inline vb blk_zero(void) { return zerov(); }
static inline vb blk_streams(vb acc, vi codes, const int8_t *x, int bits, int S) {
    for (int s = 0; s < S; s++) acc = dpu(acc, maskv(s ? shiftv(codes, s * bits) : codes, bits), loadv(x + s * W));
    return acc;
}
static inline vi blk_widen(vb acc) { return acc; }
#endif
#define LANES (W / 4) /* int32 (and float) lanes of a vector */

/* A matrix's codes and scales. int8: scales [N] (one a row), no zeros, one group a row. */
typedef struct {
    int bits, S; /* S: codes a byte */
    const uint8_t *codes;
    const uint16_t *scales, *zeros;
    long N, K, group, groups, RB, GB, block, blocks; /* RB code bytes a row, GB code bytes a group, block: inputs
                                                       an activation scale covers */
    float mid;
    int blocked; /* the block path serves its rows (qi_blocked): decided once, not at every row */
} qim;

/* One token's activation for one matrix (see the layout above). */
typedef struct {
    int8_t *xq;
    float *dx;    /* [blocks]: per activation block (qim.block inputs) */
    float *lanes; /* [full chunks * LANES]: each int32 lane's block scale dx, spread as the chunk's lanes lie */
    float *a, *b; /* [groups]: sum of x, sum of dx * xq */
    float c;      /* sum of b: int8's correction */
} qia;

const char *moetier_qi_isa(void) { return QI_ISA; }

/* Inputs an activation scale covers: a weight group of whole vectors of codes (int4's 128; at most
   QI_BIG_BLOCK), or QI_BIG_BLOCK for int8's rows, so a block's chunks add up in int32 and meet their scales once
   (one conversion and one fma a block instead of one a chunk, and no per-lane scales); otherwise QI_BLOCK. */
long moetier_qi_block(int bits, long K, long group) {
    int S = 8 / bits;
    if (bits == 8) return K % QI_BIG_BLOCK == 0 ? QI_BIG_BLOCK : QI_BLOCK;
    long GB = group / S;
    return group <= QI_BIG_BLOCK && GB >= W && GB % W == 0 ? group : QI_BLOCK;
}

static qim make_qim(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, long N, long K,
                    long group) {
    qim m = {bits, 8 / bits, codes, scales, bits == 8 ? NULL : zeros, N, K, bits == 8 ? K : group, 0, 0, 0, 0, 0, 0, 0};
    m.groups = K / m.group, m.RB = K / m.S, m.GB = m.group / m.S;
    m.block = moetier_qi_block(bits, K, group), m.blocks = K / m.block;
    m.mid = bits == 8 ? (float)INT8_BIAS : (float)(1 << (bits - 1));
    m.blocked = m.block % (W * m.S) == 0 && (bits == 8 || m.block == m.group);
    return m;
}

/* Whether the integer path covers this matrix: whole blocks in whole groups, a group's bytes a multiple or a
   divisor of the vector's (at most 8 groups a vector). */
int moetier_qi_fits(int bits, long K, long group) {
    if (bits != 8 && bits != 4 && bits != 2) return 0;
    if (K % QI_BLOCK) return 0;
    if (bits == 8) return 1;
    if (group % QI_BLOCK || K % group) return 0;
    long GB = group / (8 / bits);
    return GB >= W ? GB % W == 0 : (W % GB == 0 && W / GB <= 8);
}

/* One block of 32 activations quantized to int8 (round to nearest even): returns dx; the sums of x and codes. */
/* Eight vectors at a time (measured 8-12 us a 2,048-wide row in scalar code, run once per matrix and token). The
   rounding is vcvtps2dq's under the default MXCSR: to nearest, ties to even, as nearbyintf. */
static inline float absmax(const float *x, long n) { /* n: a multiple of 8 */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (long k = 0; k < n; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4e));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xb1));
    return _mm256_cvtss_f32(m);
}

/* 32 activations quantized against inv (= 127 / their block's max |x|) into v; their sum, and their codes'. */
static inline void quantize_block(const float *x, float inv, int8_t *v, float *sum, int *isum) {
    __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8), x2 = _mm256_loadu_ps(x + 16),
           x3 = _mm256_loadu_ps(x + 24);
    __m256 s = _mm256_set1_ps(inv);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, s)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, s)),
            i2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, s)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, s));
    __m256i total_i = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total_i), _mm256_extracti128_si256(total_i, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3)); /* lane-mixed */
    packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)v, packed);
    *sum = hsum(_mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3)));
    *isum = _mm_cvtsi128_si32(t);
}

/* The block's codes v (in input order) into the layout (input k = S * byte + stream), and its scale into the
   lanes its bytes fill. */
static inline __attribute__((always_inline)) void arrange_block(const qim *m, long blk, const int8_t *v, float dx,
                                                                qia *q, const int S) {
    const long BB = QI_BLOCK / S, byte0 = blk * BB, c = byte0 / W, full = m->RB / W;
    const long len = c < full ? W : m->RB - full * W;
    int8_t *base = q->xq + c * W * S + (byte0 - c * W);
    for (int s = 0; s < S; s++)
        for (long j = 0; j < BB; j++) base[s * len + j] = v[j * S + s];
    if (c < full)
        for (long l = (byte0 - c * W) / 4; l < (byte0 - c * W + BB) / 4; l++) q->lanes[c * LANES + l] = dx;
}

/* x [K] fp32 -> the token's quantized activation for m. */
static void quantize_act(const qim *m, const float *x, qia *q) {
    const long per = m->group / QI_BLOCK, sub = m->block / QI_BLOCK; /* 32-input pieces a group, a block */
    for (long g = 0; g < m->groups; g++) q->a[g] = q->b[g] = 0;
    q->c = 0;
    for (long blk = 0; blk < m->blocks; blk++) {
        float amax = absmax(x + blk * m->block, m->block);
        float inv = amax > 0 ? 127.0f / amax : 0.0f, dx = amax / 127.0f;
        q->dx[blk] = dx;
        for (long p = blk * sub; p < (blk + 1) * sub; p++) { /* each 32-input piece, arranged as the codes lie */
            int8_t v[QI_BLOCK];
            float sum;
            int isum;
            quantize_block(x + p * QI_BLOCK, inv, v, &sum, &isum);
            switch (m->S) {
                case 1: arrange_block(m, p, v, dx, q, 1); break;
                case 2: arrange_block(m, p, v, dx, q, 2); break;
                default: arrange_block(m, p, v, dx, q, 4);
            }
            q->a[p / per] += sum;
            q->b[p / per] += dx * (float)isum;
            q->c += dx * (float)isum;
        }
    }
}

/* sum over groups of z_g * a_g - mid * s_g * b_g for one row, eight groups at a time. */
static inline float zero_terms(const qim *m, long r, const qia *x) {
    const uint16_t *sc = m->scales + r * m->groups, *zr = m->zeros + r * m->groups;
    __m256 acc = _mm256_setzero_ps(), mid = _mm256_set1_ps(m->mid);
    long g = 0;
    for (; g + 8 <= m->groups; g += 8) {
        __m256 s = load_bf16(sc + g, 8), z = load_bf16(zr + g, 8);
        acc = _mm256_fmadd_ps(z, _mm256_loadu_ps(x->a + g), acc);
        acc = _mm256_fnmadd_ps(_mm256_mul_ps(mid, s), _mm256_loadu_ps(x->b + g), acc);
    }
    float o = hsum(acc);
    for (; g < m->groups; g++) o += bf16_to_f32(zr[g]) * x->a[g] - m->mid * bf16_to_f32(sc[g]) * x->b[g];
    return o;
}

/* Chunk c of a row's codes q against T tokens' activations, added into sum[t]. */
static inline __attribute__((always_inline)) void qi_chunk(const qim *m, const uint8_t *q, const qia *x, vf *sum,
                                                            long c, const uint16_t *sc, const uint16_t **gs,
                                                            long *left, long cpg, const int T, const int bits,
                                                            const int S, const int P) {
    _mm_prefetch((const char *)(q + c * W + QI_PREFETCH_AHEAD), _MM_HINT_T0);
    vi codes = loadv(q + c * W);
    if (bits == 8) { /* one scale a row: applied at the end */
        for (int t = 0; t < T; t++)
            sum[t] = addf(sum[t], cvtmul(dp8(zerov(), codes, loadv(x[t].xq + c * W)), loadf(x[t].lanes + c * LANES)));
        return;
    }
    vf s = P == 1 ? bcast(bf16_to_f32(**gs)) : spread(load_bf16(sc + c * P, P), P);
    if (P == 1 && --*left == 0) ++*gs, *left = cpg;
    for (int t = 0; t < T; t++)
        sum[t] = fmaf_v(cvtmul(dp_streams(codes, x[t].xq + c * S * W, bits, S), loadf(x[t].lanes + c * LANES)), s,
                        sum[t]);
    (void)m;
}

/* Whether m's rows take the block path (make_qim decides it): activation blocks of whole chunks, each meeting one
   weight scale. */
static inline int qi_blocked(const qim *m) { return m->blocked; }

/* y[t] from the row's dot product `dot[t]` (its whole chunks) plus the last, shorter chunk (scalar) and the zero
   terms (int4/int2) or int8's bias and row scale. */
static inline __attribute__((always_inline)) void qi_finish(const qim *m, long r, const qia *x, const float *dot,
                                                             float *y, const int T, const int bits) {
    const int S = 8 / bits;
    const uint8_t *q = m->codes + r * m->RB;
    const uint16_t *sc = m->scales + (bits == 8 ? r : r * m->groups);
    const long full = m->RB / W, len = m->RB - full * W;
    for (int t = 0; t < T; t++) {
        float d = dot[t];
        for (long j = 0; j < len; j++) {
            long byte = full * W + j, blk = byte * S / m->block;
            float s = bits == 8 ? 1.0f : bf16_to_f32(sc[byte / m->GB]);
            int isum = 0;
            for (int st = 0; st < S; st++) {
                int code = bits == 8 ? (int)(int8_t)q[byte] + INT8_BIAS : (q[byte] >> (st * bits)) & ((1 << bits) - 1);
                isum += code * x[t].xq[full * W * S + st * len + j];
            }
            d += s * x[t].dx[blk] * (float)isum;
        }
        y[t] = bits == 8 ? bf16_to_f32(sc[0]) * (d - (float)INT8_BIAS * x[t].c) : d + zero_terms(m, r, &x[t]);
    }
}

/* Row r (block path: qi_blocked): each block's chunks add up in int32, then meet their scales once — the
   activation block's dx, and for int4/int2 the group's (int8's row scale comes at the end). */
static inline __attribute__((always_inline)) void qi_row_blocks(const qim *m, long r, const qia *x, float *y,
                                                                  const int T, const int bits) {
    const int S = 8 / bits;
    const uint8_t *q = m->codes + r * m->RB;
    const uint16_t *sc = m->scales + r * m->groups;
    const long cpb = m->block / (W * S), blocks = m->blocks;
    vf sum[QI_MAX_TOKENS], odd[QI_MAX_TOKENS]; /* even and odd blocks: the fma's latency is not the bound */
    for (int t = 0; t < T; t++) sum[t] = odd[t] = zerof();
    for (long blk = 0; blk < blocks; blk++) {
        vi acc[QI_MAX_TOKENS];
        for (int t = 0; t < T; t++) acc[t] = zerov();
        for (long c = blk * cpb; c < (blk + 1) * cpb; c++) {
            _mm_prefetch((const char *)(q + c * W + QI_PREFETCH_AHEAD), _MM_HINT_T0);
            vi codes = loadv(q + c * W);
            for (int t = 0; t < T; t++)
                acc[t] = bits == 8 ? dp8(acc[t], codes, loadv(x[t].xq + c * W))
                                   : _add32(acc[t], dp_streams(codes, x[t].xq + c * S * W, bits, S));
        }
        float s = bits == 8 ? 1.0f : bf16_to_f32(sc[blk]);
        for (int t = 0; t < T; t++) {
            vf scale = bcast(s * x[t].dx[blk]);
            if (blk & 1) odd[t] = fmaf_v(_cvt(acc[t]), scale, odd[t]);
            else sum[t] = fmaf_v(_cvt(acc[t]), scale, sum[t]);
        }
    }
    float dot[QI_MAX_TOKENS];
    for (int t = 0; t < T; t++) dot[t] = hsumf(addf(sum[t], odd[t]));
    qi_finish(m, r, x, dot, y, T, bits);
}

/* NR rows r[0..NR) of m (block path; at most 4) against one token's activation: each row's sums made as
   qi_row_blocks makes them (the same operations in the same order: bit for bit its outputs), the activation's
   vectors loaded once for all of them and the rows' chains interleaved. Taken two at a time (qi_rows2): a SwiGLU's
   gate and up rows, which meet the same activation, or two neighbouring down rows. Why: at batch 1 an int4 expert
   is bound by the CPU, not the memory (as fast from L3 as from memory on a Zen 3), and each row's own setup,
   horizontal sums and zero terms weigh on it. A layer's eight int4 experts (OLMoE's shape, batch 1, each from
   memory) took 1.823 ms row by row and 1.576 two rows at a time, int8's 2.687 and 2.301 (Zen 3, AVX2, the two
   builds alternated in one process, medians of 16 rounds: bench/kernel_ab.py); four rows at a time no faster.
   CPB: chunks a block where the caller knows it (AVX2's int4: 2), so the chunk loop unrolls; with the int16 sums
   (blk_streams) and the even and odd blocks' sums indexed rather than branched on, that layer's int4 took 0.89x,
   0.97x and 0.91x the time (three runs of kernel_ab.py, 10-16 rounds each: faster in 9 of 10, 6 of 10, 11 of 16
   rounds; 1.845 -> 1.643 ms in the first), one expert 0.94-0.96x, int8 and int2 level, the same bits (Zen 3,
   AVX2): ~12 instructions of a 64-input chunk's ~22 had been the block's loop and its overhead. Measured later, the
   chunk loop alone takes 3 cycles a row-chunk from L1 and 10-11 from memory, the kernel's rate: at batch 1 it is
   bound by what one core's streams read (~10 GB/s there), more than by its arithmetic (docs/performance.md). */
static inline __attribute__((always_inline)) void qi_rowsn_blocks(const qim *m, const long *r, const qia *x,
                                                                   float *y, const int NR, const int bits,
                                                                   const long CPB) {
    const int S = 8 / bits;
    const uint8_t *q[4];
    const uint16_t *sc[4];
    for (int i = 0; i < NR; i++) q[i] = m->codes + r[i] * m->RB, sc[i] = m->scales + r[i] * m->groups;
    const long cpb = CPB ? CPB : m->block / (W * S), blocks = m->blocks;
    vf sum[2][4];
    for (int i = 0; i < NR; i++) sum[0][i] = sum[1][i] = zerof();
    for (long blk = 0; blk < blocks; blk++) {
        vi acc[4];
        vb part[4];
        for (int i = 0; i < NR; i++) acc[i] = zerov(), part[i] = blk_zero();
#pragma GCC unroll 4
        for (long c = blk * cpb; c < (blk + 1) * cpb; c++) {
            for (int i = 0; i < NR; i++) _mm_prefetch((const char *)(q[i] + c * W + QI_PREFETCH_AHEAD), _MM_HINT_T0);
            if (bits == 8) {
                vi xv = loadv(x->xq + c * W);
                for (int i = 0; i < NR; i++) acc[i] = dp8(acc[i], loadv(q[i] + c * W), xv);
            } else {
                const int8_t *xs = x->xq + c * S * W;
                for (int i = 0; i < NR; i++) part[i] = blk_streams(part[i], loadv(q[i] + c * W), xs, bits, S);
            }
        }
        if (bits != 8)
            for (int i = 0; i < NR; i++) acc[i] = blk_widen(part[i]);
        const int o = blk & 1;
        for (int i = 0; i < NR; i++) {
            const vf scale = bcast((bits == 8 ? 1.0f : bf16_to_f32(sc[i][blk])) * x->dx[blk]);
            sum[o][i] = fmaf_v(_cvt(acc[i]), scale, sum[o][i]);
        }
    }
    for (int i = 0; i < NR; i++) {
        const float dot = hsumf(addf(sum[0][i], sum[1][i]));
        qi_finish(m, r[i], x, &dot, y + i, 1, bits);
    }
}

/* Row r (lanes path: a chunk spans several activation blocks or weight groups): each chunk's int32 lanes meet
   their own activation scales (the `lanes` vector) and group scales (P groups a chunk, or a group of several
   chunks). */
static inline __attribute__((always_inline)) void qi_row_lanes(const qim *m, long r, const qia *x, float *y,
                                                                 const int T, const int bits) {
    const int S = 8 / bits;
    const uint8_t *q = m->codes + r * m->RB;
    const uint16_t *sc = m->scales + (bits == 8 ? r : r * m->groups);
    const long full = m->RB / W;
    const int P = m->GB >= W ? 1 : (int)(W / m->GB); /* groups a chunk */
    const long cpg = P == 1 ? m->GB / W : 1;        /* chunks a group (P == 1): no division in the loop */
    const uint16_t *gs = sc;                          /* P == 1: the scale of the group chunk c is in */
    long left = cpg;
    vf sum[QI_MAX_TOKENS], odd[QI_MAX_TOKENS];
    for (int t = 0; t < T; t++) sum[t] = odd[t] = zerof();
    long c = 0;
    for (; c + 2 <= full; c += 2) {
        qi_chunk(m, q, x, sum, c, sc, &gs, &left, cpg, T, bits, S, P);
        qi_chunk(m, q, x, odd, c + 1, sc, &gs, &left, cpg, T, bits, S, P);
    }
    if (c < full) qi_chunk(m, q, x, sum, c, sc, &gs, &left, cpg, T, bits, S, P);
    float dot[QI_MAX_TOKENS];
    for (int t = 0; t < T; t++) dot[t] = hsumf(addf(sum[t], odd[t]));
    qi_finish(m, r, x, dot, y, T, bits);
}

#define QI_CASES(B)                                                                                              \
    case B * 8 + 1: blocked ? qi_row_blocks(m, r, x, y, 1, B) : qi_row_lanes(m, r, x, y, 1, B); break;          \
    case B * 8 + 2: blocked ? qi_row_blocks(m, r, x, y, 2, B) : qi_row_lanes(m, r, x, y, 2, B); break;          \
    case B * 8 + 3: blocked ? qi_row_blocks(m, r, x, y, 3, B) : qi_row_lanes(m, r, x, y, 3, B); break;          \
    case B * 8 + 4: blocked ? qi_row_blocks(m, r, x, y, 4, B) : qi_row_lanes(m, r, x, y, 4, B); break;

/* Row r of m against T tokens' activations: y[t] = sum_k w[r, k] x_t[k]. */
static void qi_row(const qim *m, long r, const qia *x, int T, float *y) {
    const int blocked = qi_blocked(m);
    switch (m->bits * 8 + T) {
        QI_CASES(8)
        QI_CASES(4)
        QI_CASES(2)
    }
}

/* NR rows r[0..NR) of m (lanes path; at most 4) against one token's activation: each row's chunks added exactly as
   qi_row_lanes adds them (bit for bit its outputs), the rows interleaved chunk by chunk, so each chunk's activation
   vectors and lane scales are loaded once for all of them: int2's groups of 64 (one int2 expert 0.92-0.93x the
   time row by row, a layer's eight 0.94-1.00x, in two runs of bench/kernel_ab.py on a Zen 3). */
static inline __attribute__((always_inline)) void qi_rowsn_lanes(const qim *m, const long *r, const qia *x,
                                                                  float *y, const int NR, const int bits) {
    const int S = 8 / bits;
    const long full = m->RB / W;
    const int P = m->GB >= W ? 1 : (int)(W / m->GB);
    const long cpg = P == 1 ? m->GB / W : 1;
    const uint8_t *q[4];
    const uint16_t *sc[4], *gs[4];
    long left[4];
    vf sum[4], odd[4];
    for (int i = 0; i < NR; i++) {
        q[i] = m->codes + r[i] * m->RB, sc[i] = m->scales + (bits == 8 ? r[i] : r[i] * m->groups);
        gs[i] = sc[i], left[i] = cpg, sum[i] = odd[i] = zerof();
    }
    long c = 0;
    for (; c + 2 <= full; c += 2) {
        for (int i = 0; i < NR; i++) qi_chunk(m, q[i], x, &sum[i], c, sc[i], &gs[i], &left[i], cpg, 1, bits, S, P);
        for (int i = 0; i < NR; i++)
            qi_chunk(m, q[i], x, &odd[i], c + 1, sc[i], &gs[i], &left[i], cpg, 1, bits, S, P);
    }
    if (c < full)
        for (int i = 0; i < NR; i++) qi_chunk(m, q[i], x, &sum[i], c, sc[i], &gs[i], &left[i], cpg, 1, bits, S, P);
    for (int i = 0; i < NR; i++) {
        const float dot = hsumf(addf(sum[i], odd[i]));
        qi_finish(m, r[i], x, &dot, y + i, 1, bits);
    }
}

/* Rows r0 and r1 of m against one token's activation: y0, y1 as qi_row gives them, both rows at once on the paths
   the store's copies take (int8 and int4 blocked, int2 by lanes); any other matrix row by row. */
static void qi_rows2(const qim *m, long r0, long r1, const qia *x, float *y0, float *y1) {
    const long r[2] = {r0, r1};
    float y[2];
    if (m->blocked && m->bits == 8) qi_rowsn_blocks(m, r, x, y, 2, 8, 0);
    else if (m->blocked && m->bits == 4 && m->block == 2 * W * 2) qi_rowsn_blocks(m, r, x, y, 2, 4, 2); /* 2 chunks */
    else if (m->blocked && m->bits == 4) qi_rowsn_blocks(m, r, x, y, 2, 4, 0);
    else if (!m->blocked && m->bits == 2) qi_rowsn_lanes(m, r, x, y, 2, 2);
    else qi_row(m, r0, x, 1, &y[0]), qi_row(m, r1, x, 1, &y[1]);
    *y0 = y[0], *y1 = y[1];
}

static long round64(long n) { return (n + 63) & ~63L; }

/* Bytes of scratch a token needs for one matrix's activation (64-aligned pieces). */
static long act_bytes(const qim *m) {
    return round64(m->K) + round64(m->blocks * 4) + round64(m->RB / W * LANES * 4) + 2 * round64(m->groups * 4);
}

static char *take_act(const qim *m, char *p, qia *q) {
    q->xq = (int8_t *)p, p += round64(m->K);
    q->dx = (float *)p, p += round64(m->blocks * 4);
    q->lanes = (float *)p, p += round64(m->RB / W * LANES * 4);
    q->a = (float *)p, p += round64(m->groups * 4);
    q->b = (float *)p, p += round64(m->groups * 4);
    return p;
}

/* Bytes of scratch moetier_swiglu_qi needs. */
long moetier_swiglu_qi_scratch(int bits, long gu_group, long d_group, long H, long I, int T) {
    qim gu = make_qim(bits, NULL, NULL, NULL, 2 * I, H, gu_group), dn = make_qim(bits, NULL, NULL, NULL, H, I, d_group);
    return 64 + T * (act_bytes(&gu) + act_bytes(&dn)) + T * I * 4;
}

/* Rows of m a tile holds: a tile's codes (QI_TILE_BYTES) meet every pass of QI_MAX_TOKENS tokens before the next
   tile's, so the codes come from memory once for all the tokens and stay in L1/L2 between passes, and a pass's
   activations (4 x ~1.6 bytes an input) stay in L1 across the tile. Row by row, each row meeting all the tokens
   before the next (a first cut), read the tokens' activations from L2 for every row: at 64-128 tokens slower than a
   call a pass (AVX2, int4, 128 tokens: 9.9 against 8.2 ms an OLMoE expert). Each pass computes what it computes
   alone (a token's sums never depend on the others in its pass). */
static inline long tile_rows(long row_bytes) { return row_bytes >= QI_TILE_BYTES ? 1 : QI_TILE_BYTES / row_bytes; }

static inline int pass_tokens(long T, long p) { return T - p < QI_MAX_TOKENS ? (int)(T - p) : QI_MAX_TOKENS; }

/* Rows [r0, r1) of m (a tile) against every pass of T tokens' activations x, into y [T, N] bf16: y = bf16(o), or with
   `scale` (a SwiGLU's down rows and their routing weights) bf16(bf16(o) * scale[t]). */
static inline void qi_tile_bf16(const qim *m, long r0, long r1, const qia *x, long T, const float *scale, uint16_t *y,
                                long N) {
    for (long p = 0; p < T; p += QI_MAX_TOKENS) {
        const int n = pass_tokens(T, p);
        long r = r0;
        for (; n == 1 && r + 1 < r1; r += 2) { /* one token: two rows at a time */
            float o0, o1;
            qi_rows2(m, r, r + 1, x + p, &o0, &o1);
            y[p * N + r] = f32_to_bf16(scale ? round_bf16(o0) * scale[p] : o0);
            y[p * N + r + 1] = f32_to_bf16(scale ? round_bf16(o1) * scale[p] : o1);
        }
        for (; r < r1; r++) {
            float o[QI_MAX_TOKENS];
            qi_row(m, r, x + p, n, o);
            for (int t = 0; t < n; t++)
                y[(p + t) * N + r] = f32_to_bf16(scale ? round_bf16(o[t]) * scale[p + t] : o[t]);
        }
    }
}

/* One SwiGLU expert for any number T of tokens x [T, H] bf16, integer dot products (see above):
   y[t] = bf16(bf16(down . h) * weight[t]), h = bf16(bf16(silu(g)) * u), g, u = bf16(gate_up . x). Both matrices
   must fit (moetier_qi_fits). scratch: moetier_swiglu_qi_scratch bytes. More tokens than a pass: each row read
   from memory once for all of them (a tile of rows at a time: tile_rows), bit for bit what one call a pass
   computes — a prompt's expert in one call where it took one a pass (QuantizedExpert decides between this and the
   dequantized matrices' bf16 GEMM). */
void moetier_swiglu_qi(int bits, const uint8_t *gu_codes, const uint16_t *gu_scales, const uint16_t *gu_zeros,
                       long gu_group, const uint8_t *d_codes, const uint16_t *d_scales, const uint16_t *d_zeros,
                       long d_group, const uint16_t *x, const float *weight, uint16_t *y, long H, long I, int T,
                       char *scratch) {
    qim gu = make_qim(bits, gu_codes, gu_scales, gu_zeros, 2 * I, H, gu_group);
    qim dn = make_qim(bits, d_codes, d_scales, d_zeros, H, I, d_group);
    if (T < 1) return;
    qia xa[T], ha[T];
    char *p = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    for (int t = 0; t < T; t++) p = take_act(&gu, p, &xa[t]);
    for (int t = 0; t < T; t++) p = take_act(&dn, p, &ha[t]);
    float *h = (float *)p; /* [T, I] */
#pragma omp parallel if (3 * H * I * bits / 8 >= QI_PARALLEL_MIN_BYTES)
    {
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            float xf[H];
            for (long k = 0; k < H; k++) xf[k] = bf16_to_f32(x[t * H + k]);
            quantize_act(&gu, xf, &xa[t]);
        } /* barrier: every token's activation is made before the rows meet it */
        const long gu_tile = tile_rows(2 * gu.RB), dn_tile = tile_rows(dn.RB); /* (gate and up rows together) */
#pragma omp for schedule(static)
        for (long r0 = 0; r0 < I; r0 += gu_tile)
            for (long p = 0; p < T; p += QI_MAX_TOKENS) {
                const int n = pass_tokens(T, p);
                for (long r = r0; r < r0 + gu_tile && r < I; r++) {
                    float g[QI_MAX_TOKENS], u[QI_MAX_TOKENS];
                    if (n == 1) qi_rows2(&gu, r, I + r, xa + p, g, u);
                    else qi_row(&gu, r, xa + p, n, g), qi_row(&gu, I + r, xa + p, n, u);
                    for (int t = 0; t < n; t++) {
                        float gr = round_bf16(g[t]);
                        h[(p + t) * I + r] = swiglu_bf16(gr, round_bf16(u[t]));
                    }
                }
            } /* barrier: every h is written before it is quantized */
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) quantize_act(&dn, h + t * I, &ha[t]);
#pragma omp for schedule(static)
        for (long k0 = 0; k0 < H; k0 += dn_tile)
            qi_tile_bf16(&dn, k0, k0 + dn_tile < H ? k0 + dn_tile : H, ha, T, weight, y, H);
    }
}

/* y [T, N] = bf16(x [T, K] . W^T) for a quantized matrix (F.linear without bias on any number T of rows, each
   matrix row read once for all of them): the dense weights of a quantized model (attention, the head).
   scratch: moetier_linear_qi_scratch bytes. */
long moetier_linear_qi_scratch(int bits, long group, long N, long K, int T) {
    qim m = make_qim(bits, NULL, NULL, NULL, N, K, group);
    return 64 + T * act_bytes(&m);
}

void moetier_linear_qi(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, long group,
                       const uint16_t *x, uint16_t *y, long N, long K, int T, char *scratch) {
    qim m = make_qim(bits, codes, scales, zeros, N, K, group);
    if (T < 1) return;
    qia xa[T];
    char *p = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    for (int t = 0; t < T; t++) p = take_act(&m, p, &xa[t]);
#pragma omp parallel if (N * K * bits / 8 >= QI_PARALLEL_MIN_BYTES)
    {
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            float xf[K];
            for (long k = 0; k < K; k++) xf[k] = bf16_to_f32(x[t * K + k]);
            quantize_act(&m, xf, &xa[t]);
        }
        const long tile = tile_rows(m.RB);
#pragma omp for schedule(static)
        for (long n0 = 0; n0 < N; n0 += tile) qi_tile_bf16(&m, n0, n0 + tile < N ? n0 + tile : N, xa, T, NULL, y, N);
    }
}

/* Bytes of scratch moetier_swiglu_qi_layer needs for P (token, expert) pairs. */
long moetier_swiglu_qi_layer_scratch(int bits, long gu_group, long d_group, long H, long I, long P) {
    qim gu = make_qim(bits, NULL, NULL, NULL, 2 * I, H, gu_group), dn = make_qim(bits, NULL, NULL, NULL, H, I, d_group);
    return 64 + P * (act_bytes(&gu) + act_bytes(&dn)) + P * I * 4;
}

/* A layer's n experts of one precision and shape in one call: expert e takes rows span[2e] <= p < span[2e + 1]
   of xs [P, H] (at most QI_MAX_TOKENS of them) and writes those rows of ys [P, H] as moetier_swiglu_qi would, bit
   for bit (rows no expert takes are neither read nor written).
   Pointer arrays [n] name each expert's matrices (zeros may be NULL, as for int8).
   Why: a decode step at batch 1 ran 8 experts a layer as 8 calls — 8 parallel regions with 3 barriers each, 8
   trips through ctypes — and the second core idled at each region's tail. Here one region: every pair's
   activation quantized (split across threads), all experts' gate/up rows as one list of work, one barrier, the
   intermediate activations quantized, all down rows. */
void moetier_swiglu_qi_layer(int bits, long n, const uint8_t *const *gu_codes, const uint16_t *const *gu_scales,
                             const uint16_t *const *gu_zeros, long gu_group, const uint8_t *const *d_codes,
                             const uint16_t *const *d_scales, const uint16_t *const *d_zeros, long d_group,
                             const long *span, long P, const uint16_t *xs, const float *weight, uint16_t *ys,
                             long H, long I, char *scratch) {
    qim gu[n], dn[n];
    for (long e = 0; e < n; e++) {
        gu[e] = make_qim(bits, gu_codes[e], gu_scales[e], gu_zeros[e], 2 * I, H, gu_group);
        dn[e] = make_qim(bits, d_codes[e], d_scales[e], d_zeros[e], H, I, d_group);
    }
    qia xa[P], ha[P];
    char *p = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    for (long t = 0; t < P; t++) p = take_act(&gu[0], p, &xa[t]);
    for (long t = 0; t < P; t++) p = take_act(&dn[0], p, &ha[t]);
    float *h = (float *)p; /* [P, I] */
#pragma omp parallel if (n * 3 * H * I * bits / 8 >= QI_PARALLEL_MIN_BYTES)
    {
#pragma omp for schedule(static)
        for (long e = 0; e < n; e++)
            for (long t = span[2 * e]; t < span[2 * e + 1]; t++) {
                float xf[H];
                for (long k = 0; k < H; k++) xf[k] = bf16_to_f32(xs[t * H + k]);
                quantize_act(&gu[0], xf, &xa[t]);
            }
#pragma omp for schedule(static)
        for (long item = 0; item < n * I; item++) {
            const long e = item / I, r = item - e * I, a = span[2 * e];
            const int T = (int)(span[2 * e + 1] - a);
            float g[QI_MAX_TOKENS], u[QI_MAX_TOKENS];
            if (T == 1) qi_rows2(&gu[e], r, I + r, xa + a, g, u);
            else qi_row(&gu[e], r, xa + a, T, g), qi_row(&gu[e], I + r, xa + a, T, u);
            for (int t = 0; t < T; t++) {
                float gr = round_bf16(g[t]);
                h[(a + t) * I + r] = swiglu_bf16(gr, round_bf16(u[t]));
            }
        } /* barrier: every h is written before it is quantized */
#pragma omp for schedule(static)
        for (long e = 0; e < n; e++)
            for (long t = span[2 * e]; t < span[2 * e + 1]; t++) quantize_act(&dn[0], h + t * I, &ha[t]);
        const long HP = (H + 1) / 2; /* down rows in pairs (the last alone where H is odd) */
#pragma omp for schedule(static)
        for (long item = 0; item < n * HP; item++) {
            const long e = item / HP, k = 2 * (item - e * HP), a = span[2 * e];
            const int T = (int)(span[2 * e + 1] - a);
            float o[2][QI_MAX_TOKENS];
            const int rows = k + 1 < H ? 2 : 1;
            if (T == 1 && rows == 2) qi_rows2(&dn[e], k, k + 1, ha + a, o[0], o[1]);
            else
                for (int i = 0; i < rows; i++) qi_row(&dn[e], k + i, ha + a, T, o[i]);
            for (int i = 0; i < rows; i++)
                for (int t = 0; t < T; t++)
                    ys[(a + t) * H + k + i] = f32_to_bf16(round_bf16(o[i][t]) * weight[a + t]);
        }
    }
}

/* Bytes of scratch moetier_swiglu_qi_token needs for n experts. */
long moetier_swiglu_qi_token_scratch(int bits, long gu_group, long d_group, long H, long I, long n) {
    qim gu = make_qim(bits, NULL, NULL, NULL, 2 * I, H, gu_group), dn = make_qim(bits, NULL, NULL, NULL, H, I, d_group);
    return 64 + act_bytes(&gu) + n * act_bytes(&dn) + round64(n * I * 4) + n * H * 4;
}

/* One token through a layer's n experts of one precision and shape, their outputs summed: out [H] =
   sum over e ascending, in fp32, of bf16(bf16(down_e . h_e) * weight[e]), rounded to bf16 once — bit for bit what
   moetier_swiglu_qi_layer on n copies of the row followed by moetier_sum_rows_bf16 (the combine) computes. Why: at
   batch 1 that was a gather of n copies of the row, n quantizations of the same activation and a combine call, each
   with the Python around it (~70 us a layer of a decode step here, against ~1 ms of expert kernels); here the row is
   quantized once (the experts share its shape) and summed where the outputs are made. Pointer arrays [n] as for
   moetier_swiglu_qi_layer. scratch: moetier_swiglu_qi_token_scratch bytes. */
void moetier_swiglu_qi_token(int bits, long n, const uint8_t *const *gu_codes, const uint16_t *const *gu_scales,
                             const uint16_t *const *gu_zeros, long gu_group, const uint8_t *const *d_codes,
                             const uint16_t *const *d_scales, const uint16_t *const *d_zeros, long d_group,
                             const uint16_t *x, const float *weight, uint16_t *out, long H, long I, char *scratch) {
    qim gu[n], dn[n];
    for (long e = 0; e < n; e++) {
        gu[e] = make_qim(bits, gu_codes[e], gu_scales[e], gu_zeros[e], 2 * I, H, gu_group);
        dn[e] = make_qim(bits, d_codes[e], d_scales[e], d_zeros[e], H, I, d_group);
    }
    qia xa, ha[n];
    char *p = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    p = take_act(&gu[0], p, &xa);
    for (long e = 0; e < n; e++) p = take_act(&dn[0], p, &ha[e]);
    float *h = (float *)p;                      /* [n, I] */
    float *ys = (float *)(p + round64(n * I * 4)); /* [n, H]: each expert's output as the layer kernel rounds it */
    {
        float xf[H];
        for (long k = 0; k < H; k++) xf[k] = bf16_to_f32(x[k]);
        quantize_act(&gu[0], xf, &xa);
    }
#pragma omp parallel if (n * 3 * H * I * bits / 8 >= QI_PARALLEL_MIN_BYTES)
    {
#pragma omp for schedule(static)
        for (long item = 0; item < n * I; item++) {
            const long e = item / I, r = item - e * I;
            float g, u;
            qi_rows2(&gu[e], r, I + r, &xa, &g, &u);
            float gr = round_bf16(g);
            h[e * I + r] = swiglu_bf16(gr, round_bf16(u));
        } /* barrier: every h is written before it is quantized */
#pragma omp for schedule(static)
        for (long e = 0; e < n; e++) quantize_act(&dn[0], h + e * I, &ha[e]);
        const long HP = (H + 1) / 2; /* down rows in pairs (the last alone where H is odd) */
#pragma omp for schedule(static)
        for (long item = 0; item < n * HP; item++) {
            const long e = item / HP, k = 2 * (item - e * HP);
            float o[2];
            if (k + 1 < H) qi_rows2(&dn[e], k, k + 1, &ha[e], &o[0], &o[1]);
            else qi_row(&dn[e], k, &ha[e], 1, &o[0]);
            for (int i = 0; i < 2 && k + i < H; i++) ys[e * H + k + i] = round_bf16(round_bf16(o[i]) * weight[e]);
        } /* barrier: every expert's output is made before they are summed */
#pragma omp for schedule(static)
        for (long k = 0; k < H; k++) out[k] = f32_to_bf16(sum_column(ys, n, H, k));
    }
}
