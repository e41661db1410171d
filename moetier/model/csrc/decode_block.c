/* A decode token's attention block at batch 1 in one call: the residual stream's update by the previous layer's
   MLP or experts, the input norm, the stacked q/k/v product, the q/k norms, RoPE, the KV write, the attention over
   the cache, the output product, the residual add, the post-attention norm and the router's product.

   Why: each of those is a native kernel already, but reached from Python they cost ~10 ctypes calls, as many
   torch tensors and views, and the residual adds as torch ops, all run with the caches cold from the weights just
   streamed (moetier/model/decode_block.py has the measurements). Here the same kernels run in
   the same order on the same values, every intermediate rounded to bf16 where the reference rounds it, so the
   output is bit for bit what the separate calls give (tests/model/test_decode_block.py). */

#include <stdint.h>

#include "bf16.h"

void moetier_linear_bf16(const uint16_t *W, const uint16_t *x, const uint16_t *bias, uint16_t *y, long N, long K,
                         float *scratch);
void moetier_rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *y, long rows, long n, float eps);
void moetier_rope_bf16(const uint16_t *x, const uint16_t *cos, const uint16_t *sin, uint16_t *y, long heads, long d);
void moetier_decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, long hq,
                                   long hkv, long start, long end, long s_max, long d, float scale, float *scratch);
void moetier_kv_write(const char *k, const char *v, char *k_row, char *v_row, long heads, long max_len, long d,
                      long size, long position);
void moetier_linear_qi(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, long group,
                       const uint16_t *x, uint16_t *y, long N, long K, int T, char *scratch);

long moetier_gq_act_bytes(int type, long K);
void moetier_gq_quantize_act(int type, const float *x, long K, int T, void *out);
void moetier_gq_linear(int type, const uint8_t *w, long N, long K, const void *act, int T, float *y);

#define GGML_BITS -1 /* a GGUF's matrix in GGML blocks (q_ggml.c): weight, scales and zeros hold up to three parts'
                        blocks (q, k and v, kept apart: a Q4_K_M file's v may be Q6_K beside Q4_K q and k), group
                        their types (GQ_*), four bits each */

/* A product's weight: bf16 rows (bits 16), a quantized matrix's codes, scales and zeros (bits 8, 4 or 2: what
   QuantizedDenseKernels.linear computes, its bias added to the rounded product as its `y + bias` adds it), or a
   GGUF's blocks (GGML_BITS). */
typedef struct {
    const void *weight, *scales, *zeros;
    const uint16_t *bias; /* NULL: none */
    long bits, group;
} moetier_matrix;

/* One layer's norms (bf16; NULL: absent), products and shapes, made once per layer by the caller.
   qk_norm: 0 none, 1 one norm over all heads (OLMoE), 2 per head over head_dim (Qwen3). window: 0 for none. */
typedef struct {
    const uint16_t *input_norm, *q_norm, *k_norm, *post_attn_norm;
    moetier_matrix qkv_proj, o_proj, router; /* router.weight NULL: the caller routes from `x` itself */
    long hidden, heads, kv_heads, head_dim, num_experts, qk_norm, window;
    float eps, scale;
} moetier_decode_layer;

/* y [N] = x [K] through GGUF blocks in up to three parts of n0, n1 and N - n0 - n1 rows, each part as
   QuantizedDenseKernels computes a BlockMatrix: x quantized for its type, the fp32 product rounded to bf16.
   scratch: K + N floats and the activation's bytes. */
static void product_ggml(const moetier_matrix *m, const uint16_t *x, uint16_t *y, long N, long K, long n0, long n1,
                         float *scratch) {
    float *xf = scratch, *yf = xf + K;
    char *act = (char *)(yf + N);
    const void *parts[3] = {m->weight, m->scales, m->zeros};
    const long rows[3] = {n0, n1, N - n0 - n1};
    for (long i = 0; i < K; i++) xf[i] = bf16_to_f32(x[i]);
    for (int p = 0, first = 0, quantized = -1; p < 3 && rows[p] > 0; first += (int)rows[p], p++) {
        const int type = (int)(m->group >> (4 * p)) & 0xF;
        if (type != quantized) /* q, k and v mostly share a type: x quantized once for them */
            moetier_gq_quantize_act(type, xf, K, 1, act), quantized = type;
        moetier_gq_linear(type, parts[p], rows[p], K, act, 1, yf + first);
    }
    for (long i = 0; i < N; i++) y[i] = f32_to_bf16(yf[i]);
    if (m->bias) add_bf16(y, m->bias, N);
}

/* y [N] = x [K] through m; scratch: floats for a bf16 product, bytes (moetier_linear_qi_scratch) for a quantized
   one; n0, n1: a GGUF matrix's parts (product_ggml). */
static void product(const moetier_matrix *m, const uint16_t *x, uint16_t *y, long N, long K, long n0, long n1,
                    float *scratch) {
    if (m->bits == GGML_BITS) {
        product_ggml(m, x, y, N, K, n0, n1, scratch);
        return;
    }
    if (m->bits == 16) {
        moetier_linear_bf16(m->weight, x, m->bias, y, N, K, scratch);
        return;
    }
    moetier_linear_qi((int)m->bits, m->weight, m->scales, m->zeros, m->group, x, y, N, K, 1, (char *)scratch);
    if (m->bias) add_bf16(y, m->bias, N);
}

/* h [H]: the residual stream, updated in place: h += delta (if not NULL), then h += attention(norm(h)).
   x [H]: post_attn_norm(h) afterwards; logits [E]: the router's bf16 product of x as floats (if L->router.weight:
   the values the router's softmax would widen them to, so it need not).
   k_cache, v_cache: this sequence's cache rows [kv_heads, max_len, head_dim]; the token sits at `position`.
   cos, sin: the RoPE table's rows [head_dim] at that position.
   work: bf16, 2 H + 4 (heads + kv_heads) head_dim + num_experts values; scratch: what the products need
   (`product`) and the attention (position + 1 + 2 head_dim floats for each of the team's threads). */
void moetier_decode_block_bf16(const moetier_decode_layer *L, uint16_t *h, const uint16_t *delta, uint16_t *k_cache,
                               uint16_t *v_cache, long max_len, long position, const uint16_t *cos, const uint16_t *sin,
                               uint16_t *x, float *logits, uint16_t *work, float *scratch) {
    const long H = L->hidden, d = L->head_dim, nq = L->heads * d, nkv = L->kv_heads * d, nqkv = nq + 2 * nkv;
    uint16_t *xn = work, *qkv = xn + H, *qk = qkv + nqkv, *q = qk + nq + nkv, *k = q + nq, *att = k + nkv,
             *o = att + nq, *router = o + H;
    if (delta) add_bf16(h, delta, H);
    moetier_rms_norm_bf16(h, L->input_norm, xn, 1, H, L->eps);
    product(&L->qkv_proj, xn, qkv, nqkv, H, nq, nkv, scratch);
    const uint16_t *qs = qkv, *ks = qkv + nq, *vs = qkv + nq + nkv;
    if (L->qk_norm == 1) { /* over all heads at once */
        moetier_rms_norm_bf16(qs, L->q_norm, qk, 1, nq, L->eps);
        moetier_rms_norm_bf16(ks, L->k_norm, qk + nq, 1, nkv, L->eps);
        qs = qk, ks = qk + nq;
    } else if (L->qk_norm == 2) { /* each head over head_dim */
        moetier_rms_norm_bf16(qs, L->q_norm, qk, L->heads, d, L->eps);
        moetier_rms_norm_bf16(ks, L->k_norm, qk + nq, L->kv_heads, d, L->eps);
        qs = qk, ks = qk + nq;
    }
    moetier_rope_bf16(qs, cos, sin, q, L->heads, d);
    moetier_rope_bf16(ks, cos, sin, k, L->kv_heads, d);
    moetier_kv_write((const char *)k, (const char *)vs, (char *)k_cache, (char *)v_cache, L->kv_heads, max_len, d, 2,
                     position);
    const long end = position + 1, start = L->window && end > L->window ? end - L->window : 0;
    moetier_decode_attention_bf16(q, k_cache, v_cache, att, L->heads, L->kv_heads, start, end, max_len, d,
                                  L->scale, scratch);
    product(&L->o_proj, att, o, H, nq, H, 0, scratch);
    add_bf16(h, o, H);
    moetier_rms_norm_bf16(h, L->post_attn_norm, x, 1, H, L->eps);
    if (L->router.weight) {
        product(&L->router, x, router, L->num_experts, H, L->num_experts, 0, scratch);
        for (long e = 0; e < L->num_experts; e++) logits[e] = bf16_to_f32(router[e]);
    }
}

void moetier_linear_bf16_rows(const uint16_t *W, const uint16_t *X, const uint16_t *bias, uint16_t *Y, long N, long K,
                              long T, float *scratch);
void moetier_gq_linear_tokens(int type, const uint8_t *w, long N, long K, const void *act, long T, float *yt);
#define GQ_MAX_TOKENS 4 /* (q_ggml.c's: tokens a pass of moetier_gq_linear) */

/* y [B, N] = x [B, K] through m, B > 1 rows, each row bit for bit what `product` computes for it alone — the calls
   the layer-by-layer forward makes for a batch (the kernels' `linear` on B rows): bf16 rows (moetier_linear_bf16_rows),
   the integer kernel on B rows, a GGUF's parts with x quantized once per type for all rows.
   scratch: B (K + N) floats and B activations' bytes for GGUF blocks; B K floats for bf16 rows; the integer kernel's
   bytes (moetier_linear_qi_scratch for B rows) for a quantized matrix. */
static void product_rows(const moetier_matrix *m, const uint16_t *x, uint16_t *y, long B, long N, long K, long n0,
                         long n1, float *scratch) {
    if (m->bits == 16) {
        moetier_linear_bf16_rows(m->weight, x, m->bias, y, N, K, B, scratch);
        return;
    }
    if (m->bits != GGML_BITS) {
        moetier_linear_qi((int)m->bits, m->weight, m->scales, m->zeros, m->group, x, y, N, K, (int)B, (char *)scratch);
        if (m->bias)
            for (long t = 0; t < B; t++) add_bf16(y + t * N, m->bias, N);
        return;
    }
    float *xf = scratch, *yf = xf + B * K; /* yf: a part's outputs, [B, rows] (a pass) or [rows, B] (passes) */
    char *act = (char *)(yf + B * N);
    const void *parts[3] = {m->weight, m->scales, m->zeros};
    const long rows[3] = {n0, n1, N - n0 - n1};
    for (long i = 0; i < B * K; i++) xf[i] = bf16_to_f32(x[i]);
    for (int p = 0, first = 0, quantized = -1; p < 3 && rows[p] > 0; first += (int)rows[p], p++) {
        const int type = (int)(m->group >> (4 * p)) & 0xF;
        if (type != quantized) moetier_gq_quantize_act(type, xf, K, (int)B, act), quantized = type;
        const long n = rows[p];
        if (B <= GQ_MAX_TOKENS) {
            moetier_gq_linear(type, parts[p], n, K, act, (int)B, yf);
            for (long t = 0; t < B; t++)
                for (long r = 0; r < n; r++) y[t * N + first + r] = f32_to_bf16(yf[t * n + r]);
        } else {
            moetier_gq_linear_tokens(type, parts[p], n, K, act, B, yf);
            for (long t = 0; t < B; t++)
                for (long r = 0; r < n; r++) y[t * N + first + r] = f32_to_bf16(yf[r * B + t]);
        }
    }
    if (m->bias)
        for (long t = 0; t < B; t++) add_bf16(y + t * N, m->bias, N);
}

/* moetier_decode_block_bf16 for a decode step of B > 1 sequences (a server's batch), each row computed as the block
   computes it alone — the products for all rows at once (each weight read once for the batch), the norms, RoPE,
   the cache write and the attention row by row at each sequence's own place: the logits the layer-by-layer forward
   gives a batch, bit for bit (tests/model/test_decode_block.py). Why: at batch 2 a Q4_K_M OLMoE step spent ~10 ms of
   ~51 in its attention's four products and the Python around them (the block's ~6 ms at batch 1).
   h, x [B, H]; delta [B, H] or NULL; logits [B, E]; row b's cache rows at k_layer + row_bytes[b] (v likewise), its
   token at position[b], its RoPE rows cos[b], sin[b]. work: B times the bf16 values the block's work holds;
   scratch: what `product_rows` needs for the largest product, and the attention's (as the block's). */
void moetier_decode_block_rows(const moetier_decode_layer *L, long B, uint16_t *h, const uint16_t *delta,
                               char *k_layer, char *v_layer, const long *row_bytes, long max_len, const long *position,
                               const uint16_t *const *cos, const uint16_t *const *sin, uint16_t *x, float *logits,
                               uint16_t *work, float *scratch) {
    const long H = L->hidden, d = L->head_dim, nq = L->heads * d, nkv = L->kv_heads * d, nqkv = nq + 2 * nkv;
    const long E = L->num_experts;
    uint16_t *xn = work, *qkv = xn + B * H, *qk = qkv + B * nqkv, *q = qk + B * (nq + nkv), *k = q + B * nq,
             *att = k + B * nkv, *o = att + B * nq, *router = o + B * H;
    if (delta) add_bf16(h, delta, B * H);
    moetier_rms_norm_bf16(h, L->input_norm, xn, B, H, L->eps);
    product_rows(&L->qkv_proj, xn, qkv, B, nqkv, H, nq, nkv, scratch);
    for (long b = 0; b < B; b++) {
        const uint16_t *qs = qkv + b * nqkv, *ks = qs + nq, *vs = qs + nq + nkv;
        uint16_t *qkb = qk + b * (nq + nkv), *qb = q + b * nq, *kb = k + b * nkv;
        if (L->qk_norm == 1) {
            moetier_rms_norm_bf16(qs, L->q_norm, qkb, 1, nq, L->eps);
            moetier_rms_norm_bf16(ks, L->k_norm, qkb + nq, 1, nkv, L->eps);
            qs = qkb, ks = qkb + nq;
        } else if (L->qk_norm == 2) {
            moetier_rms_norm_bf16(qs, L->q_norm, qkb, L->heads, d, L->eps);
            moetier_rms_norm_bf16(ks, L->k_norm, qkb + nq, L->kv_heads, d, L->eps);
            qs = qkb, ks = qkb + nq;
        }
        moetier_rope_bf16(qs, cos[b], sin[b], qb, L->heads, d);
        moetier_rope_bf16(ks, cos[b], sin[b], kb, L->kv_heads, d);
        uint16_t *k_cache = (uint16_t *)(k_layer + row_bytes[b]), *v_cache = (uint16_t *)(v_layer + row_bytes[b]);
        moetier_kv_write((const char *)kb, (const char *)vs, (char *)k_cache, (char *)v_cache, L->kv_heads, max_len,
                         d, 2, position[b]);
        const long end = position[b] + 1, start = L->window && end > L->window ? end - L->window : 0;
        moetier_decode_attention_bf16(qb, k_cache, v_cache, att + b * nq, L->heads, L->kv_heads, start, end, max_len,
                                      d, L->scale, scratch);
    }
    product_rows(&L->o_proj, att, o, B, H, nq, H, 0, scratch);
    add_bf16(h, o, B * H);
    moetier_rms_norm_bf16(h, L->post_attn_norm, x, B, H, L->eps);
    if (L->router.weight) {
        product_rows(&L->router, x, router, B, E, H, E, 0, scratch);
        for (long i = 0; i < B * E; i++) logits[i] = bf16_to_f32(router[i]);
    }
}
