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
