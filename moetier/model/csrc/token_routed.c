/* One token's routed experts straight from the router's output and a layer's table of expert addresses: the k
   (id, weight) pairs put in ascending id order with the weights as fp32 — what a plan of resident runs computes
   them in — then the token kernel (bf16 or integer) on those experts.

   Why: at batch 1 with every expert resident, ordering the ids, converting the weights and gathering the addresses
   in numpy and torch cost ~110 us a layer on OLMoE-1B-7B (Zen 4; ~1.8 ms of a bf16 step), with the caches cold from
   the weights just streamed (moetier/engine/resident_layers.py). */

#include <stdint.h>

#include "bf16.h"

void moetier_swiglu_bf16_token(long n, const uint16_t *const *gate_up, const uint16_t *const *down, const uint16_t *x,
                               const float *weight, uint16_t *out, long H, long I, float *scratch);
void moetier_swiglu_qi_token(int bits, long n, const uint8_t *const *gu_codes, const uint16_t *const *gu_scales,
                             const uint16_t *const *gu_zeros, long gu_group, const uint8_t *const *d_codes,
                             const uint16_t *const *d_scales, const uint16_t *const *d_zeros, long d_group,
                             const uint16_t *x, const float *weight, uint16_t *out, long H, long I, char *scratch);

/* ids [k] int64 (distinct), weights [k] (bits 32: fp32; 16: bf16) -> id, w [k]: ascending ids, fp32 weights. */
static void ascending(const int64_t *ids, const void *weights, long bits, long k, int64_t *id, float *w) {
    for (long j = 0; j < k; j++) {
        const int64_t e = ids[j];
        const float v = bits == 32 ? ((const float *)weights)[j] : bf16_to_f32(((const uint16_t *)weights)[j]);
        long i = j;
        for (; i > 0 && id[i - 1] > e; i--) id[i] = id[i - 1], w[i] = w[i - 1];
        id[i] = e, w[i] = v;
    }
}

/* table [E, 2]: each expert's gate_up_proj and down_proj addresses; scratch as moetier_swiglu_bf16_token's for k. */
void moetier_swiglu_bf16_token_routed(const int64_t *table, const int64_t *ids, const void *weights, long bits,
                                      long k, const uint16_t *x, uint16_t *out, long H, long I, float *scratch) {
    int64_t id[k];
    float w[k];
    const uint16_t *gate_up[k], *down[k];
    ascending(ids, weights, bits, k, id, w);
    for (long j = 0; j < k; j++)
        gate_up[j] = (const uint16_t *)table[id[j] * 2], down[j] = (const uint16_t *)table[id[j] * 2 + 1];
    moetier_swiglu_bf16_token(k, gate_up, down, x, w, out, H, I, scratch);
}

/* table [E, 6]: each expert's codes, scales and zeros (0: none) of gate_up_proj, then of down_proj; scratch as
   moetier_swiglu_qi_token's for k. */
void moetier_swiglu_qi_token_routed(int bits, const int64_t *table, const int64_t *ids, const void *weights,
                                    long wbits, long k, long gu_group, long d_group, const uint16_t *x, uint16_t *out,
                                    long H, long I, char *scratch) {
    int64_t id[k];
    float w[k];
    const void *p[6][k];
    ascending(ids, weights, wbits, k, id, w);
    for (long j = 0; j < k; j++)
        for (int m = 0; m < 6; m++) p[m][j] = (const void *)table[id[j] * 6 + m];
    moetier_swiglu_qi_token(bits, k, (const uint8_t *const *)p[0], (const uint16_t *const *)p[1],
                            (const uint16_t *const *)p[2], gu_group, (const uint8_t *const *)p[3],
                            (const uint16_t *const *)p[4], (const uint16_t *const *)p[5], d_group, x, w, out, H, I,
                            scratch);
}

void moetier_gq_swiglu_token(long n, const int *gu_type, const uint8_t *const *gu, const int *d_type,
                             const uint8_t *const *d, const uint16_t *x, const float *weight, uint16_t *out, long H,
                             long I, char *scratch);

/* table [E, 4]: each expert's gate_up_proj blocks and their GGML type (q_ggml.c's GQ_*), its down_proj's and theirs:
   a GGUF's (or a GGML copy's) experts as GgmlExpert computes them one by one — each its bf16 output scaled by its
   weight rounded to bf16 (moetier_gq_swiglu) — in ascending ids, then summed as the kernels' combine sums them
   (moetier_sum_rows_bf16): what `token` gives, in one call (moetier_gq_swiglu_token; scratch:
   moetier_gq_token_scratch(k, H, I) bytes, q_ggml.c). */
void moetier_gq_swiglu_token_routed(const int64_t *table, const int64_t *ids, const void *weights, long wbits,
                                    long k, long H, long I, const uint16_t *x, uint16_t *out, char *scratch) {
    int64_t id[k];
    float w[k];
    int gu_type[k], d_type[k];
    const uint8_t *gu[k], *d[k];
    ascending(ids, weights, wbits, k, id, w);
    for (long j = 0; j < k; j++) {
        const int64_t *e = table + id[j] * 4;
        gu[j] = (const uint8_t *)e[0], gu_type[j] = (int)e[1], d[j] = (const uint8_t *)e[2], d_type[j] = (int)e[3];
        w[j] = round_bf16(w[j]); /* the weight as a bf16 value, as GgmlExpert passes it */
    }
    moetier_gq_swiglu_token(k, gu_type, gu, d_type, d, x, w, out, H, I, scratch);
}

void moetier_gq_glu_token(long n, const int *gu_type, const uint8_t *const *gu, const int *d_type,
                          const uint8_t *const *d, const float *const *gu_bias, const float *const *d_bias,
                          float alpha, float limit, const uint16_t *x, const float *weight, uint16_t *out, long H,
                          long I, char *scratch);

/* As moetier_gq_swiglu_token_routed for gpt-oss's experts: table [E, 6], each expert's gate_up_proj blocks and type,
   down_proj's and theirs, then its gate_up_proj and down_proj biases (fp32 [2I], [H]); the clamped SwiGLU of
   GgmlClampedExpert (alpha, limit) in one call (moetier_gq_glu_token; scratch: moetier_gq_token_scratch). */
void moetier_gq_glu_token_routed(const int64_t *table, const int64_t *ids, const void *weights, long wbits, long k,
                                 long H, long I, float alpha, float limit, const uint16_t *x, uint16_t *out,
                                 char *scratch) {
    int64_t id[k];
    float w[k];
    int gu_type[k], d_type[k];
    const uint8_t *gu[k], *d[k];
    const float *gu_bias[k], *d_bias[k];
    ascending(ids, weights, wbits, k, id, w);
    for (long j = 0; j < k; j++) {
        const int64_t *e = table + id[j] * 6;
        gu[j] = (const uint8_t *)e[0], gu_type[j] = (int)e[1], d[j] = (const uint8_t *)e[2], d_type[j] = (int)e[3];
        gu_bias[j] = (const float *)e[4], d_bias[j] = (const float *)e[5];
        w[j] = round_bf16(w[j]);
    }
    moetier_gq_glu_token(k, gu_type, gu, d_type, d, gu_bias, d_bias, alpha, limit, x, w, out, H, I, scratch);
}
