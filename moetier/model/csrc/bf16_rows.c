/* Rows of bf16 activations through bf16 weights on AVX2 CPUs (and AVX-512 BF16 ones: see the first `dot`): one row
   (a batch-1 decode step) at memory speed, several (a server's decode batch, a prefill) with each weight row read
   once for all of them.

   Why: torch's bf16 matrix-vector path converts and accumulates at ~7.5 GB/s per core here, below what the
   memory delivers (~20 GB/s on two cores); a decode step is nothing but such products, so it ran at 0.7 of the
   memory roofline. Here each 32-byte load of 16 bf16 weights becomes two fp32 vectors by interleaving zero
   halves (one instruction per 8 values: a bf16 is the top half of an fp32), fed to FMAs with the activation
   permuted once per call into the same order (see `dot` for the loop).

   Arithmetic: products and sums in fp32 as torch's kernels do, in a different order, then one rounding to
   bf16 (nearest even) where torch rounds: every op's output. So results equal torch's up to the last bit of
   an output that lands near a rounding boundary.

   Threads: rows are split across the OpenMP team. This library links libgomp by its soname, so inside torch's
   process it shares torch's OpenMP runtime and thread count (torch.set_num_threads) instead of starting a
   second pool that would fight it for the cores. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define PARALLEL_MIN_BYTES (256 * 1024) /* below this, waking the team costs more than it saves */

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* AVX-512 BF16 (Zen 4, Sapphire Rapids, Cooper Lake): vdpbf16ps multiplies 32 bf16 pairs and adds each two
   neighbours' products into 16 fp32 lanes, so a 64-byte load of weights is one instruction — against the AVX2
   path's load, two unpacks and two FMAs per 16 values. The activation is kept in bf16, in order (`xval`); every
   value the kernels feed it is a bf16 already (an input, or h rounded to bf16 as the reference rounds it), so
   nothing is lost by keeping it so. The products are exact in fp32 and summed in fp32 as on the AVX2 path, in
   another order; the instruction treats subnormal inputs as zero (|x| < 2^-126: none in a model's weights or
   activations). */
typedef uint16_t xval;
#define XVAL_OF_BF16(v) (v)
#define XVAL_OF_F32(f) f32_to_bf16(f)
static inline long permuted(long i) { return i; }

static inline __m512bh bh(__m512i v) { return (__m512bh)v; }

/* No software prefetch: on a Zen 4 the AVX2 path's (1 KiB ahead) made this loop 10-15% slower from memory
   (8 experts of 2048 x 1024 a call, alternated 6 times: median 3.6 against 3.2 ms without), at every distance
   and density tried (0.5-4 KiB, 2 or 4 lines a step); the hardware prefetcher keeps up alone. */
static float dot(const uint16_t *w, const xval *x, long K) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    long k = 0;
    for (; k + 128 <= K; k += 128) {
        a0 = _mm512_dpbf16_ps(a0, bh(_mm512_loadu_si512(x + k)), bh(_mm512_loadu_si512(w + k)));
        a1 = _mm512_dpbf16_ps(a1, bh(_mm512_loadu_si512(x + k + 32)), bh(_mm512_loadu_si512(w + k + 32)));
        a2 = _mm512_dpbf16_ps(a2, bh(_mm512_loadu_si512(x + k + 64)), bh(_mm512_loadu_si512(w + k + 64)));
        a3 = _mm512_dpbf16_ps(a3, bh(_mm512_loadu_si512(x + k + 96)), bh(_mm512_loadu_si512(w + k + 96)));
    }
    for (; k + 32 <= K; k += 32)
        a0 = _mm512_dpbf16_ps(a0, bh(_mm512_loadu_si512(x + k)), bh(_mm512_loadu_si512(w + k)));
    if (k < K) { /* the tail, masked: lanes past K load as zeros and add nothing */
        __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        a1 = _mm512_dpbf16_ps(a1, bh(_mm512_maskz_loadu_epi16(m, x + k)), bh(_mm512_maskz_loadu_epi16(m, w + k)));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#else
/* The activation as fp32, in the order the weights' unpacking leaves them in (below). */
typedef float xval;
#define XVAL_OF_BF16(v) bf16_to_f32(v)
#define XVAL_OF_F32(f) (f)

/* Where element i of an activation vector is kept so that it meets its weight: in each full block of 16, the
   order unpacklo/unpackhi leave the weights in, [0-3, 8-11 | 4-7, 12-15]; the tail past the last full block
   stays in order. */
static inline long permuted(long i) {
    long j = i & 15;
    return (i & ~15L) | (j < 4 || j >= 12 ? j : j ^ 12); /* 4-7 <-> 8-11 */
}

#define ZERO_UNPACK_FMA(w, acc_lo, acc_hi)                                                                   \
    do {                                                                                                     \
        __m256i v = _mm256_loadu_si256((const __m256i *)(w));                                                \
        acc_lo = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v)), xl, acc_lo);          \
        acc_hi = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v)), xh, acc_hi);          \
    } while (0)

/* One row . x in fp32. Rows are read one after another (a single forward stream per thread, which the
   hardware prefetcher follows across rows; four rows at once measured 10% slower), 64 values per step into
   eight accumulators (the FMA latency), with a software prefetch 1 KiB ahead (measured best of 0.5-2 KiB). */
#define PREFETCH_AHEAD 512 /* values */
static float dot(const uint16_t *w, const float *xp, long K) {
    const __m256i zero = _mm256_setzero_si256();
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0, xl, xh;
    long k = 0;
    for (; k + 64 <= K; k += 64) {
        _mm_prefetch((const char *)(w + k + PREFETCH_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + k + PREFETCH_AHEAD + 32), _MM_HINT_T0);
        xl = _mm256_loadu_ps(xp + k), xh = _mm256_loadu_ps(xp + k + 8);
        ZERO_UNPACK_FMA(w + k, a0, b0);
        xl = _mm256_loadu_ps(xp + k + 16), xh = _mm256_loadu_ps(xp + k + 24);
        ZERO_UNPACK_FMA(w + k + 16, a1, b1);
        xl = _mm256_loadu_ps(xp + k + 32), xh = _mm256_loadu_ps(xp + k + 40);
        ZERO_UNPACK_FMA(w + k + 32, a2, b2);
        xl = _mm256_loadu_ps(xp + k + 48), xh = _mm256_loadu_ps(xp + k + 56);
        ZERO_UNPACK_FMA(w + k + 48, a3, b3);
    }
    for (; k + 16 <= K; k += 16) {
        xl = _mm256_loadu_ps(xp + k), xh = _mm256_loadu_ps(xp + k + 8);
        ZERO_UNPACK_FMA(w + k, a0, b0);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1)),
                             _mm256_add_ps(_mm256_add_ps(a2, b2), _mm256_add_ps(a3, b3)));
    float sum = hsum(s);
    for (; k < K; k++) sum += bf16_to_f32(w[k]) * xp[k];
    return sum;
}
#endif

/* y[N] = W[N, K] . x[K], fp32; x already permuted */
static void gemv(const uint16_t *W, const xval *xp, float *y, long N, long K) {
#pragma omp parallel for schedule(static) if (N * K * 2 >= PARALLEL_MIN_BYTES)
    for (long r = 0; r < N; r++) y[r] = dot(W + r * K, xp, K);
}

/* F.linear on one row: y[N] = bf16(W[N, K] . x[K] + bias[N]); bias may be NULL.
   scratch: at least K + N floats. */
void moetier_linear_bf16(const uint16_t *W, const uint16_t *x, const uint16_t *bias, uint16_t *y, long N, long K,
                         float *scratch) {
    xval *xf = (xval *)scratch;
    float *acc = scratch + K;
    long full = K & ~15L;
    for (long k = 0; k < K; k++) xf[k < full ? permuted(k) : k] = XVAL_OF_BF16(x[k]);
    gemv(W, xf, acc, N, K);
    if (bias)
        for (long n = 0; n < N; n++) y[n] = f32_to_bf16(acc[n] + bf16_to_f32(bias[n]));
    else
        for (long n = 0; n < N; n++) y[n] = f32_to_bf16(acc[n]);
}

/* One token through one SwiGLU expert, rounding where the reference's bf16 ops round:
   y[H] = bf16(bf16(down . bf16(bf16(silu(g)) * u)) * weight), with g, u = bf16(gate_up[2I, H] . x); the weight is
   the routing weight as a float (exact for a bf16 one), 1 for an expert that is not routed.
   One parallel region: each thread takes gate rows with their up rows, so it can finish h = silu(g) * u for them
   on its own, written straight into the permuted order the down product reads; one barrier; then the
   down rows.
   scratch: at least H + I floats. */
void moetier_swiglu_bf16(const uint16_t *gate_up, const uint16_t *down, const uint16_t *x, float weight,
                         uint16_t *y, long H, long I, float *scratch) {
    xval *xf = (xval *)scratch, *hp = (xval *)(scratch + H); /* hp: I values, permuted */
    long hfull = H & ~15L, ifull = I & ~15L;
    for (long k = 0; k < H; k++) xf[k < hfull ? permuted(k) : k] = XVAL_OF_BF16(x[k]);
#pragma omp parallel if (3 * H * I * 2 >= PARALLEL_MIN_BYTES)
    {
#pragma omp for schedule(static)
        for (long r = 0; r < I; r++) {
            float g = round_bf16(dot(gate_up + r * H, xf, H)), u = round_bf16(dot(gate_up + (I + r) * H, xf, H));
            hp[r < ifull ? permuted(r) : r] = XVAL_OF_F32(swiglu_bf16(g, u));
        } /* its implicit barrier: every h is written before any down row reads them */
#pragma omp for schedule(static)
        for (long k = 0; k < H; k++) y[k] = f32_to_bf16(round_bf16(dot(down + k * I, hp, I)) * weight);
    }
}

/* 1 / sqrt(mean(x^2) + eps) of a bf16 row, the sum of squares in double. */
static inline float inverse_rms(const uint16_t *xr, long n, float eps) {
    double ss = 0;
    for (long k = 0; k < n; k++) {
        float v = bf16_to_f32(xr[k]);
        ss += (double)(v * v);
    }
    return 1.0f / sqrtf((float)(ss / (double)n) + eps);
}

/* RMSNorm of each row of x [rows, n] as transformers computes it in bf16: h = fp32(x) * rsqrt(mean(h^2) + eps),
   rounded to bf16, then times the weight (a bf16 product, rounded). The sum of squares is kept in double, so it
   is at least as exact as torch's fp32 cascade. One decode row costs ~2 us here against ~30 us for the eight
   torch ops it replaces; 4 norms a layer. */
void moetier_rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *y, long rows, long n, float eps) {
    for (long r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * n;
        uint16_t *yr = y + r * n;
        const float inv = inverse_rms(xr, n, eps);
        for (long k = 0; k < n; k++) yr[k] = f32_to_bf16(bf16_to_f32(weight[k]) * round_bf16(bf16_to_f32(xr[k]) * inv));
    }
}

/* As moetier_rms_norm_bf16 for gpt-oss's norm (layers.rms_norm_fp32_weight): the weight applied to the fp32 h and
   one rounding at the end, h not rounded before it. */
void moetier_rms_norm_fp32w_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *y, long rows, long n,
                                 float eps) {
    for (long r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * n;
        uint16_t *yr = y + r * n;
        const float inv = inverse_rms(xr, n, eps);
        for (long k = 0; k < n; k++) yr[k] = f32_to_bf16(bf16_to_f32(weight[k]) * (bf16_to_f32(xr[k]) * inv));
    }
}

/* Rotary embedding of one position over x [heads, d] in place of torch's five ops: out = x * cos + rotate_half(x)
   * sin with each product and the sum rounded to bf16 as torch's bf16 ops do. cos, sin: [d] bf16 rows of the
   table at this position. */
void moetier_rope_bf16(const uint16_t *x, const uint16_t *cos, const uint16_t *sin, uint16_t *y, long heads, long d) {
    long half = d / 2;
    for (long h = 0; h < heads; h++) {
        const uint16_t *xh = x + h * d;
        uint16_t *yh = y + h * d;
        for (long k = 0; k < d; k++) {
            float rot = k < half ? -bf16_to_f32(xh[k + half]) : bf16_to_f32(xh[k - half]);
            float a = round_bf16(bf16_to_f32(xh[k]) * bf16_to_f32(cos[k]));
            float b = round_bf16(rot * bf16_to_f32(sin[k]));
            yh[k] = f32_to_bf16(a + b);
        }
    }
}

/* Eight bf16 values widened to fp32 (a bf16 is the top half of an fp32). */
static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* q . k over d values in fp32, eight lanes at a time (d is a multiple of 8 in every family; a tail is kept). */
static inline float dot_f32_bf16(const float *q, const uint16_t *k, long d) {
    __m256 acc = _mm256_setzero_ps();
    long c = 0;
    for (; c + 8 <= d; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), load8_bf16(k + c), acc);
    float s = hsum(acc);
    for (; c < d; c++) s += q[c] * bf16_to_f32(k[c]);
    return s;
}

/* One query token's attention over its cached keys [start, end) (grouped-query: query head h reads kv head
   h / (hq / hkv)), as torch's CPU flash kernel computes it for bf16: scores q.k in fp32 times the scale, softmax
   numerators exp(s - max) in fp32 summed in fp32, the numerators rounded to bf16 before they weight the values,
   the fp32 sum of those divided by the numerators' sum and rounded once. (Measured against
   F.scaled_dot_product_attention at 16 heads of 128: 95% of outputs bit-identical at a context of 48, 64% at
   2000, where torch's kernel works through the keys in blocks; the largest error against an fp64 reference
   is torch's own at both.) The values are
   accumulated key by key across a row of d lanes, so each output sums its keys in order and the loop vectorises.
   ~40 us a layer at OLMoE's shape (16 heads of 128) and a context of 48, where the torch call costs ~170 us.
   k, v: this sequence's cache rows, [hkv, s_max, d]; out: [hq, d]; scratch: (end + 2 d) floats for each of the
   team's threads (moetier_threads()). `sink`: gpt-oss's learned logit of the head, one more in the softmax that
   weights no value (-INFINITY: none, the same arithmetic as without). */
static void attend_head(const uint16_t *q, const uint16_t *kh, const uint16_t *vh, uint16_t *out, long start,
                        long end, long d, float scale, float sink, float *scratch) {
    float *p = scratch, *qf = scratch + end, *o = qf + d;
    for (long c = 0; c < d; c++) qf[c] = bf16_to_f32(q[c]);
    float m = sink;
    for (long j = start; j < end; j++) {
        p[j] = dot_f32_bf16(qf, kh + j * d, d) * scale;
        if (p[j] > m) m = p[j];
    }
    float total = expf(sink - m); /* (0 without a sink) */
    for (long j = start; j < end; j++) {
        float e = expf(p[j] - m);
        total += e;
        p[j] = round_bf16(e);
    }
    for (long c = 0; c < d; c++) o[c] = 0;
    for (long j = start; j < end; j++) {
        const uint16_t *vr = vh + j * d;
        __m256 pj = _mm256_set1_ps(p[j]);
        long c = 0;
        for (; c + 8 <= d; c += 8)
            _mm256_storeu_ps(o + c, _mm256_fmadd_ps(pj, load8_bf16(vr + c), _mm256_loadu_ps(o + c)));
        for (; c < d; c++) o[c] += p[j] * bf16_to_f32(vr[c]);
    }
    for (long c = 0; c < d; c++) out[c] = f32_to_bf16(o[c] / total);
}

/* Heads are split across the team where the keys and values read are worth waking it for (~40 us a layer alone
   at OLMoE's 16 heads of 128 and a context of 48; at a context of 2000 each layer reads 16 MiB of cache): each
   head computed by one thread as it is alone, each thread with its own part of scratch. */
#define ATTENTION_PARALLEL_MIN (64L * 1024) /* heads x keys x d below which one thread does it */

/* sinks: each query head's sink logit, bf16 [hq] (gpt-oss), or NULL. */
void moetier_decode_attention_sinks_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                                         long hq, long hkv, long start, long end, long s_max, long d, float scale,
                                         const uint16_t *sinks, float *scratch) {
    const long group = hq / hkv, per_thread = end + 2 * d;
#pragma omp parallel if (hq * (end - start) * d >= ATTENTION_PARALLEL_MIN)
    {
        float *mine = scratch + (long)omp_get_thread_num() * per_thread;
#pragma omp for schedule(static)
        for (long h = 0; h < hq; h++)
            attend_head(q + h * d, k + (h / group) * s_max * d, v + (h / group) * s_max * d, out + h * d, start,
                        end, d, scale, sinks ? bf16_to_f32(sinks[h]) : -INFINITY, mine);
    }
}

void moetier_decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, long hq,
                                   long hkv, long start, long end, long s_max, long d, float scale, float *scratch) {
    moetier_decode_attention_sinks_bf16(q, k, v, out, hq, hkv, start, end, s_max, d, scale, NULL, scratch);
}

/* One token's expert outputs ys [P, H] summed in order into y [H] as the reference's index_add_ into a bf16 zero
   row sums them: in fp32, row after row, rounded to bf16 once at the end (checked bit for bit against torch 2.13
   for 1-16 rows). ~1 us against ~20 us for zeros_like + index_add_ at batch 1. */
void moetier_sum_rows_bf16(const uint16_t *ys, long P, long H, uint16_t *y) {
    for (long k = 0; k < H; k++) {
        float acc = 0.0f;
        for (long p = 0; p < P; p++) acc += bf16_to_f32(ys[p * H + k]);
        y[k] = f32_to_bf16(acc);
    }
}

/* F.linear on T rows at once: Y[T, N] = bf16(W[N, K] . X[t] + bias[N]), each row bit for bit what
   moetier_linear_bf16 gives it alone (the same `dot`, the same rounding). Why: a decode step of T sequences (a
   server's batch), and a prefill's T tokens; torch's bf16 product on a CPU without AVX-512 BF16 runs at ~18
   GFLOP/s here (a 4096 x 2048 matrix: ~1 ms a row at any T), this at ~50: each weight row comes from memory once
   and is dotted with the T rows while it sits in L1. bias may be NULL. scratch: at least T * K floats. */
void moetier_linear_bf16_rows(const uint16_t *W, const uint16_t *X, const uint16_t *bias, uint16_t *Y, long N,
                              long K, long T, float *scratch) {
    xval *xf = (xval *)scratch; /* [T, K] permuted */
    long full = K & ~15L;
#pragma omp parallel for schedule(static) if (T * K >= 65536)
    for (long t = 0; t < T; t++)
        for (long k = 0; k < K; k++) xf[t * K + (k < full ? permuted(k) : k)] = XVAL_OF_BF16(X[t * K + k]);
#pragma omp parallel for schedule(static) if (N * K * 2 >= PARALLEL_MIN_BYTES)
    for (long r = 0; r < N; r++) {
        for (long t = 0; t < T; t++) {
            float acc = dot(W + r * K, xf + t * K, K);
            Y[t * N + r] = f32_to_bf16(bias ? acc + bf16_to_f32(bias[r]) : acc);
        }
    }
}

/* A layer's n SwiGLU experts in one call, each on its own rows of xs [P, H]: expert e computes rows
   spans[2e] .. spans[2e + 1] - 1 into the same rows of ys, each row bit for bit what moetier_swiglu_bf16 computes
   for it alone (weight[row] its routing weight; 1 for an expert that is not routed). gate_up[e], down[e]: its
   matrices.
   Why: one parallel region and one barrier for the layer instead of a region and a barrier an expert (a decode
   step at batch 1 ran 8 calls a layer through ctypes, the second core idling at every region's tail); and an
   expert with several tokens (a batch's) reads each weight row once for all of them, dotting it with each token
   while it sits in L1, where torch's bf16 product costs each token a full pass.
   scratch: at least P * (H + I) floats. */
void moetier_swiglu_bf16_layer(long n, const uint16_t *const *gate_up, const uint16_t *const *down,
                               const long *spans, long P, const uint16_t *xs, const float *weight, uint16_t *ys,
                               long H, long I, float *scratch) {
    long hfull = H & ~15L, ifull = I & ~15L;
    xval *xf = (xval *)scratch, *hp = (xval *)(scratch + P * H); /* [P, H], [P, I]: permuted */
#pragma omp parallel if (n * 3 * H * I * 2 >= PARALLEL_MIN_BYTES)
    {
#pragma omp for schedule(static)
        for (long p = 0; p < P; p++)
            for (long k = 0; k < H; k++) xf[p * H + (k < hfull ? permuted(k) : k)] = XVAL_OF_BF16(xs[p * H + k]);
#pragma omp for schedule(static)
        for (long item = 0; item < n * I; item++) {
            const long e = item / I, r = item - e * I;
            const uint16_t *g_row = gate_up[e] + r * H, *u_row = gate_up[e] + (I + r) * H;
            for (long p = spans[2 * e]; p < spans[2 * e + 1]; p++) {
                float g = round_bf16(dot(g_row, xf + p * H, H)), u = round_bf16(dot(u_row, xf + p * H, H));
                float h = swiglu_bf16(g, u);
                hp[p * I + (r < ifull ? permuted(r) : r)] = XVAL_OF_F32(h);
            }
        } /* its implicit barrier: every h is written before any down row reads them */
#pragma omp for schedule(static)
        for (long item = 0; item < n * H; item++) {
            const long e = item / H, k = item - e * H;
            const uint16_t *d_row = down[e] + k * I;
            for (long p = spans[2 * e]; p < spans[2 * e + 1]; p++)
                ys[p * H + k] = f32_to_bf16(round_bf16(dot(d_row, hp + p * I, I)) * weight[p]);
        }
    }
}

/* One token through a layer's n experts, their outputs summed: out [H] = sum over e ascending, in fp32, of
   bf16(bf16(down_e . h_e) * weight[e]), rounded to bf16 once — bit for bit what moetier_swiglu_bf16_layer on n
   copies of the row followed by moetier_sum_rows_bf16 (the combine) computes, the row converted once and no copies
   of it made. Why: at batch 1 the copies, the grouping and the combine call cost ~50 us a layer of Python and
   torch ops around ~3 ms of expert kernels. scratch: H + n * (I + H) floats. */
void moetier_swiglu_bf16_token(long n, const uint16_t *const *gate_up, const uint16_t *const *down, const uint16_t *x,
                               const float *weight, uint16_t *out, long H, long I, float *scratch) {
    long hfull = H & ~15L, ifull = I & ~15L;
    xval *xf = (xval *)scratch, *hp = (xval *)(scratch + H); /* [H], [n, I]: permuted */
    float *ys = scratch + H + n * I;                          /* [n, H]: each expert's output, as the layer rounds it */
    for (long k = 0; k < H; k++) xf[k < hfull ? permuted(k) : k] = XVAL_OF_BF16(x[k]);
#pragma omp parallel if (n * 3 * H * I * 2 >= PARALLEL_MIN_BYTES)
    {
#pragma omp for schedule(static)
        for (long item = 0; item < n * I; item++) {
            const long e = item / I, r = item - e * I;
            float g = round_bf16(dot(gate_up[e] + r * H, xf, H)), u = round_bf16(dot(gate_up[e] + (I + r) * H, xf, H));
            hp[e * I + (r < ifull ? permuted(r) : r)] = XVAL_OF_F32(swiglu_bf16(g, u));
        } /* its implicit barrier: every h is written before any down row reads them */
#pragma omp for schedule(static)
        for (long item = 0; item < n * H; item++) {
            const long e = item / H, k = item - e * H;
            ys[e * H + k] = round_bf16(round_bf16(dot(down[e] + k * I, hp + e * I, I)) * weight[e]);
        } /* barrier: every expert's output is made before they are summed */
#pragma omp for schedule(static)
        for (long k = 0; k < H; k++) out[k] = f32_to_bf16(sum_column(ys, n, H, k));
    }
}

/* One decode token's keys and values [heads, d] (elements of `size` bytes) into its cache row [heads, max_len, d] at
   `position`: what KVCache.write's index_put does for one token, without building and checking its two index
   tensors (~30 us a layer in a decode step here; this ~2). */
void moetier_kv_write(const char *k, const char *v, char *k_row, char *v_row, long heads, long max_len, long d,
                      long size, long position) {
    const long bytes = d * size;
    for (long h = 0; h < heads; h++) {
        memcpy(k_row + (h * max_len + position) * bytes, k + h * bytes, (size_t)bytes);
        memcpy(v_row + (h * max_len + position) * bytes, v + h * bytes, (size_t)bytes);
    }
}

/* The OpenMP team's size now (torch.set_num_threads sets it): how many parts of scratch a parallel kernel uses. */
long moetier_threads(void) { return omp_get_max_threads(); }
