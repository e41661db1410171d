/* A whole one-sequence decode step through every layer in one call, where every expert is resident: for each
   layer the attention block (decode_block.c), the softmax router's choice (route.c) and the token's experts from
   the layer's table of addresses (token_routed.c) — the calls the layer-by-layer Python makes, in its order, on
   the same values, so the residual stream comes out the same bit for bit (tests/model/test_decode_block.py).

   Why: from Python each layer is three native calls and the ops between, and each call pays the caches being cold
   from the weights just streamed — a bare ctypes call took 2.5 us warm and 37 us right after a 100 MB read, three
   torch.empty 4.5 and 52 us (Zen 4) — ~4.8 ms of a ~75 ms bf16 step on OLMoE-1B-7B outside the kernels. The
   policy hears the step's routes afterwards, in their order, from the buffers written here
   (moetier/engine/resident_layers.py: nothing is decided between layers when every expert stays resident). */

#include <stdint.h>

#include "bf16.h"

typedef struct moetier_decode_layer moetier_decode_layer;
void moetier_decode_block_bf16(const moetier_decode_layer *L, uint16_t *h, const uint16_t *delta, uint16_t *k_cache,
                               uint16_t *v_cache, long max_len, long position, const uint16_t *cos, const uint16_t *sin,
                               uint16_t *x, float *logits, uint16_t *work, float *scratch);
void moetier_route_softmax(const void *logits, long bits, long T, long E, long k, long norm, float scale,
                           long round_bf16, float *scores, int64_t *ids, void *weights);
void moetier_swiglu_bf16_token_routed(const int64_t *table, const int64_t *ids, const void *weights, long bits,
                                      long k, const uint16_t *x, uint16_t *out, long H, long I, float *scratch);
void moetier_swiglu_qi_token_routed(int bits, const int64_t *table, const int64_t *ids, const void *weights,
                                    long wbits, long k, long gu_group, long d_group, const uint16_t *x, uint16_t *out,
                                    long H, long I, char *scratch);
void moetier_gq_swiglu_token_routed(const int64_t *table, const int64_t *ids, const void *weights, long wbits,
                                    long k, long H, long I, const uint16_t *x, uint16_t *out, char *scratch);

#define GGML_BITS -1 /* a table of GGML blocks and their types, [E, 4] (token_routed.c) */

/* One MoE layer's part of the step: its block, its cache rows, its experts' table and what the router writes. */
typedef struct {
    const moetier_decode_layer *block;
    uint16_t *k_cache, *v_cache;  /* this sequence's rows [kv_heads, max_len, head_dim] */
    const int64_t *table;         /* [E, 2] bf16 (bits 16), [E, 6] quantized or [E, 4] GGML (GGML_BITS) addresses */
    long bits, intermediate, gu_group, d_group;
    float *logits, *scores;       /* [E] each */
    int64_t *ids;                 /* [k] */
    void *weights;                /* [k]: fp32, or bf16 if round_bf16 */
    uint16_t *x;                  /* [H]: the experts' input (the post-attention norm) */
} moetier_step_layer;

/* The router's constants (one softmax router for the model). */
typedef struct {
    long num_experts, top_k, norm, round_bf16;
    float scale;
} moetier_step_route;

/* h [H]: the embedded token in, the residual stream after the last layer's experts out (before the final norm).
   delta: H bf16 values of work; work, scratch: as moetier_decode_block_bf16's; expert_scratch: as the experts' token
   call needs (the larger of the bf16 and integer kernels' for k experts). */
void moetier_decode_step_resident(long n, const moetier_step_layer *layers, const moetier_step_route *route,
                                  uint16_t *h, long H, long max_len, long position, const uint16_t *cos,
                                  const uint16_t *sin, uint16_t *delta, uint16_t *work, float *scratch,
                                  char *expert_scratch) {
    for (long i = 0; i < n; i++) {
        const moetier_step_layer *l = layers + i;
        moetier_decode_block_bf16(l->block, h, i ? delta : 0, l->k_cache, l->v_cache, max_len, position, cos, sin,
                                  l->x, l->logits, work, scratch);
        moetier_route_softmax(l->logits, 32, 1, route->num_experts, route->top_k, route->norm, route->scale,
                              route->round_bf16, l->scores, l->ids, l->weights);
        const long wbits = route->round_bf16 ? 16 : 32;
        if (l->bits == GGML_BITS)
            moetier_gq_swiglu_token_routed(l->table, l->ids, l->weights, wbits, route->top_k, H, l->intermediate, l->x,
                                           delta, expert_scratch);
        else if (l->bits == 16)
            moetier_swiglu_bf16_token_routed(l->table, l->ids, l->weights, wbits, route->top_k, l->x, delta, H,
                                             l->intermediate, (float *)expert_scratch);
        else
            moetier_swiglu_qi_token_routed((int)l->bits, l->table, l->ids, l->weights, wbits, route->top_k,
                                           l->gu_group, l->d_group, l->x, delta, H, l->intermediate, expert_scratch);
    }
    add_bf16(h, delta, H); /* the last layer's experts, as torch's h + delta */
}
