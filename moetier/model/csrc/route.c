/* The softmax router's choice in one call: softmax over the experts in fp32, the top k, renormalised if the family
   does, times its scaling factor, rounded to the weights' dtype — SoftmaxRouter.route's four or five torch ops.

   Why: at batch 1 those ops each cost ~30 us on OLMoE-1B-7B (Zen 4) with the caches cold from the expert weights
   streamed just before — ~2 ms of a ~50 ms bf16 step for 64 numbers a layer (moetier/model/router.py).

   The experts chosen are torch.topk's, in its order, ties included: bf16 logits tie often (1.8% of random rows of
   64 tie at the k-th place), and torch breaks a tie as its selection happens to leave the (score, index) pairs —
   libstdc++'s nth_element then sort of the first k - 1 (partial_sort where k * 64 <= E), comparing scores only
   (aten/src/ATen/native/TopKImpl.h). `select_top` below makes the same moves, so the same expert wins a tie.
   The scores are torch's to a few ulps, not bit for bit (its vectorised exp and order of sums): here expf(x - max)
   times 1/sum, as torch's form, summed in index order. A tie is two equal logits, which both compute alike. */

#include <math.h>
#include <stdint.h>

#include "bf16.h"

typedef struct {
    float score;
    int64_t id;
} pair;

/* torch.topk's order: a before b if a's score is larger, or a NaN where b's is not */
static inline int before(const pair *a, const pair *b) {
    return (isnan(a->score) && !isnan(b->score)) || a->score > b->score;
}

static inline void swap(pair *a, pair *b) {
    pair t = *a;
    *a = *b, *b = t;
}

static long floor_log2(long n) {
    long l = 0;
    while (n >>= 1) l++;
    return l;
}

/* libstdc++'s moves (bits/stl_algo.h, stl_heap.h), step for step, with `before` as the comparison. */

/* *i moved back past the ones it goes before; unguarded: something before it stops it */
static void unguarded_linear_insert(pair *i) {
    pair v = *i, *j = i;
    for (; before(&v, j - 1); j--) *j = *(j - 1);
    *j = v;
}

static void insertion_sort(pair *first, pair *last) {
    if (first == last) return;
    for (pair *i = first + 1; i != last; i++) {
        if (before(i, first)) {
            pair v = *i;
            for (pair *j = i; j != first; j--) *j = *(j - 1);
            *first = v;
        } else {
            unguarded_linear_insert(i); /* *first stops it */
        }
    }
}

static void move_median_to_first(pair *result, pair *a, pair *b, pair *c) {
    if (before(a, b)) {
        if (before(b, c)) swap(result, b);
        else if (before(a, c)) swap(result, c);
        else swap(result, a);
    } else if (before(a, c)) swap(result, a);
    else if (before(b, c)) swap(result, c);
    else swap(result, b);
}

static pair *unguarded_partition(pair *first, pair *last, const pair *pivot) {
    for (;;) {
        while (before(first, pivot)) first++;
        last--;
        while (before(pivot, last)) last--;
        if (!(first < last)) return first;
        swap(first, last);
        first++;
    }
}

static pair *partition_pivot(pair *first, pair *last) {
    pair *mid = first + (last - first) / 2;
    move_median_to_first(first, first + 1, mid, last - 1);
    return unguarded_partition(first + 1, last, first);
}

static void push_heap(pair *first, long hole, long top, pair v) {
    long parent = (hole - 1) / 2;
    while (hole > top && before(first + parent, &v)) {
        first[hole] = first[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    first[hole] = v;
}

static void adjust_heap(pair *first, long hole, long len, pair v) {
    const long top = hole;
    long child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (before(first + child, first + (child - 1))) child--;
        first[hole] = first[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        first[hole] = first[child - 1];
        hole = child - 1;
    }
    push_heap(first, hole, top, v);
}

static void make_heap(pair *first, pair *last) {
    const long len = last - first;
    if (len < 2) return;
    for (long parent = (len - 2) / 2;; parent--) {
        adjust_heap(first, parent, len, first[parent]);
        if (parent == 0) return;
    }
}

static void pop_heap(pair *first, pair *last, pair *result) {
    pair v = *result;
    *result = *first;
    adjust_heap(first, 0, last - first, v);
}

static void heap_select(pair *first, pair *middle, pair *last) {
    make_heap(first, middle);
    for (pair *i = middle; i < last; i++)
        if (before(i, first)) pop_heap(first, middle, i);
}

static void sort_heap(pair *first, pair *last) {
    while (last - first > 1) {
        last--;
        pop_heap(first, last, last);
    }
}

static void nth_element(pair *first, pair *nth, pair *last) {
    if (first == last || nth == last) return;
    long depth = 2 * floor_log2(last - first);
    while (last - first > 3) {
        if (depth == 0) {
            heap_select(first, nth + 1, last);
            swap(first, nth);
            return;
        }
        depth--;
        pair *cut = partition_pivot(first, last);
        if (cut <= nth) first = cut;
        else last = cut;
    }
    insertion_sort(first, last);
}

static void introsort_loop(pair *first, pair *last, long depth) {
    while (last - first > 16) {
        if (depth == 0) {
            heap_select(first, last, last);
            sort_heap(first, last);
            return;
        }
        depth--;
        pair *cut = partition_pivot(first, last);
        introsort_loop(cut, last, depth);
        last = cut;
    }
}

static void sort(pair *first, pair *last) {
    if (first == last) return;
    introsort_loop(first, last, 2 * floor_log2(last - first));
    if (last - first > 16) {
        insertion_sort(first, first + 16);
        for (pair *i = first + 16; i != last; i++) unguarded_linear_insert(i);
    } else {
        insertion_sort(first, last);
    }
}

/* The k best of queue[0, n) moved to its front, in torch.topk's order (sorted=True, largest=True). */
static void select_top(pair *queue, long n, long k) {
    if (k == 0) return;
    if (k * 64 <= n) {
        heap_select(queue, queue + k, queue + n);
        sort_heap(queue, queue + k);
    } else {
        nth_element(queue, queue + k - 1, queue + n);
        sort(queue, queue + k - 1);
    }
}

/* logits [T, E] (bits 32: fp32; 16: bf16) -> scores [T, E] fp32, ids [T, k] int64 (descending score),
   weights [T, k] (fp32, or bf16 if round_bf16: the reference's `.to(bfloat16)`). */
void moetier_route_softmax(const void *logits, long bits, long T, long E, long k, long norm, float scale,
                           long round_bf16, float *scores, int64_t *ids, void *weights) {
    for (long t = 0; t < T; t++) {
        float *s = scores + t * E;
        for (long e = 0; e < E; e++)
            s[e] = bits == 32 ? ((const float *)logits)[t * E + e] : bf16_to_f32(((const uint16_t *)logits)[t * E + e]);
        float max = s[0], sum = 0.0f;
        for (long e = 1; e < E; e++) max = s[e] > max ? s[e] : max;
        for (long e = 0; e < E; e++) sum += s[e] = expf(s[e] - max);
        const float inv = 1.0f / sum;
        for (long e = 0; e < E; e++) s[e] *= inv;

        pair queue[E];
        for (long e = 0; e < E; e++) queue[e].score = s[e], queue[e].id = e;
        select_top(queue, E, k);
        float w[k > 0 ? k : 1];
        for (long j = 0; j < k; j++) w[j] = queue[j].score, ids[t * k + j] = queue[j].id;
        if (norm) {
            float total = 0.0f;
            for (long j = 0; j < k; j++) total += w[j];
            for (long j = 0; j < k; j++) w[j] /= total;
        }
        for (long j = 0; j < k; j++) {
            const float v = scale == 1.0f ? w[j] : w[j] * scale;
            if (round_bf16) ((uint16_t *)weights)[t * k + j] = f32_to_bf16(v);
            else ((float *)weights)[t * k + j] = v;
        }
    }
}
