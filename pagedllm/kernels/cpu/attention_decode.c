/* Paged decode attention for CPUs: each decode row (one query token) attends to its keys straight from
 * the paged cache, with no gathered copy of the keys or values. A request verifying draft tokens has
 * one row per new token, each with its own length (its position + 1) over the request's block table.
 *
 * Built at run time into the dense kernel library by kernels/build.py with the system C compiler (the
 * one torch.compile's Inductor uses on CPU) and loaded with ctypes (bindings:
 * attention/backends/cpu_decode.py). It links the OpenMP runtime torch has already loaded, so it
 * shares torch's threads instead of adding a second pool on the same cores. Vector width and
 * intrinsics follow the build's target (vec.h).
 *
 * Layouts (element strides, contiguous unless a stride is passed):
 *   q        [rows, num_heads, head_size], row stride q_stride (a view of the fused QKV output)
 *   k, v     [num_blocks, num_kv_heads, block_size, head_size]
 *   tables   int32 [*, table_stride]: cache block ids of each request
 *   out      [rows, num_heads, head_size], row stride out_stride
 * Decode row i reads query row q_rows[i], block-table row table_rows[i], seq_lens[i] keys (the last
 * `window` of them, if window > 0; scores soft-capped if soft_cap > 0), and writes output row q_rows[i].
 *
 * Work item = (run of rows, kv head, part of its keys), a run being the consecutive rows of one
 * request (its block-table row): a decode token, or the 1 + k tokens verifying k drafts. Each key and
 * value is read from memory once for all the run's query vectors (its rows times the group's query
 * heads), each masked to its own row's keys: verifying drafts reads the cache as one decode does.
 * Softmax is online per segment of keys that fits L1 (flash decoding): the segment's keys and values
 * are widened to float once, then each query vector takes its scores (LANES keys to a vector out of
 * one transpose-sum), one rescale of its accumulators, and its value sums.
 *
 * The cache holds the activations' type, or fp8 (e4m3 or e5m2: a quarter / half the bytes to read)
 * storing x / scale with one key and one value scale per layer: the key scale is folded into the
 * query, the value scale into the output, so an fp8 element costs only its widening to float.
 */
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention.h"
#include "vec.h"

/* Rows in a run: a request's new tokens in a step (MAX_DECODE_QUERY_LEN in Python); a run of longer
 * heads and groups is cut so that its query vectors fit QUERY_FLOATS. */
#define MAX_RUN_ROWS 8
#define MAX_QUERIES (MAX_RUN_ROWS * MAX_GROUP)
#define QUERY_FLOATS 8192
/* Keys per segment: as many as SEGMENT_FLOATS widened floats of keys (and of values) hold, in
 * multiples of LANES, at most MAX_SEGMENT. */
#define SEGMENT_FLOATS 2048
#define MAX_SEGMENT 128
#define SEGMENT_BUFFER (LANES * MAX_HEAD > SEGMENT_FLOATS ? LANES * MAX_HEAD : SEGMENT_FLOATS)
/* Vector accumulators of the value sums held at once (the register file: 16 on AVX2, 32 on AVX-512). */
#define VALUE_CHUNKS (LANES == 16 ? 16 : 8)

/* x in fp8 `type`: saturated to the largest finite value, rounded to nearest even. */
INLINE uint8_t float_to_fp8(float x, int type) {
    const int shift = 23 - FP8_MANT(type);
    float a = fabsf(x);
    a = a < FP8_MAX(type) ? a : FP8_MAX(type); /* also NaN -> the largest value */
    a *= pow2(FP8_BIAS(type) - 127); /* the bits' value read as a float's */
    uint32_t u;
    memcpy(&u, &a, sizeof u);
    u += ((1u << shift) >> 1) - 1 + ((u >> shift) & 1u);
    return (uint8_t)((u >> shift) | (signbit(x) ? 0x80u : 0u));
}

typedef struct {
    const char *q, *k, *v;
    char *out;
    const int32_t *tables;
    const int64_t *q_rows, *table_rows, *seq_lens;
    int64_t q_stride, out_stride, table_stride, num_kv_heads, group, block_size, window;
    float scale;
    float soft_cap; /* 0: none */
    float k_scale, v_scale; /* of an fp8 cache, times FP8_LOAD_SCALE; 1 otherwise */
} DecodeArgs;

/* Row r's first key (a sliding window starts past 0); its keys are [first_key, seq_lens[r]). */
INLINE int64_t first_key(const DecodeArgs *a, int64_t r) {
    const int64_t len = a->seq_lens[r];
    return (a->window > 0 && len > a->window) ? len - a->window : 0;
}

/* Rows [row, row + rows) of one request, attending to keys within [k_begin, k_end) between them. */
typedef struct {
    int64_t row, rows, k_begin, k_end;
} Run;

/* Splits `num_rows` rows into runs (consecutive rows of one block-table row, at most `most` each);
 * returns how many. */
static int64_t find_runs(const DecodeArgs *a, int64_t num_rows, int64_t most, Run *runs) {
    int64_t n = 0;
    for (int64_t r = 0; r < num_rows; r++) {
        Run *last = n ? &runs[n - 1] : NULL;
        if (last && last->rows < most && a->table_rows[r] == a->table_rows[last->row]) {
            last->rows++;
            last->k_begin = first_key(a, r) < last->k_begin ? first_key(a, r) : last->k_begin;
            last->k_end = a->seq_lens[r] > last->k_end ? a->seq_lens[r] : last->k_end;
        } else {
            runs[n++] = (Run){r, 1, first_key(a, r), a->seq_lens[r]};
        }
    }
    return n;
}

#define L2_AHEAD 16

/* Asks for kv head h's keys and values in cache block `block` (`bytes` each) to be brought into L2. */
INLINE void prefetch_block(const DecodeArgs *a, int64_t block, int64_t h, int64_t bytes) {
    const int64_t base = (block * a->num_kv_heads + h) * bytes;
    for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(a->k + base + off, 0, 2);
        __builtin_prefetch(a->v + base + off, 0, 2);
    }
}

/* Key rows of a segment past its keys: scored (then masked), never summed. */
static const float zero_row[MAX_HEAD];

/* Attention of run `run`'s query vectors of kv head h over its keys [k_begin, k_end). With `partial`
 * NULL the result is final and goes to `out`; otherwise each query vector's unnormalized state
 * (running max, sum, weighted values: 2 + D floats) goes there for merge_splits. `nc` is the head
 * size in LANES-float chunks, a compile-time constant in the specialized copies; `bf16` selects the
 * activations' element type, `kv` the cache's. */
INLINE void decode_task(const DecodeArgs *a, const Run *run, int64_t h, int64_t k_begin, int64_t k_end,
                        float *partial, const int64_t nc, const int bf16, const int kv) {
    const int64_t D = nc * LANES, group = a->group, M = run->rows * group, elem = bf16 ? 2 : 4;
    const int64_t bs = a->block_size, row_bytes = D * ELEM_SIZE(kv);
    int64_t seg = SEGMENT_FLOATS / D / LANES * LANES;
    seg = seg < LANES ? LANES : seg > MAX_SEGMENT ? MAX_SEGMENT : seg;
    const int32_t *table = a->tables + a->table_rows[run->row] * a->table_stride;
    float q[QUERY_FLOATS] __attribute__((aligned(64))), o[QUERY_FLOATS] __attribute__((aligned(64)));
    float kf[SEGMENT_BUFFER] __attribute__((aligned(64))), vf[SEGMENT_BUFFER] __attribute__((aligned(64)));
    float p[MAX_SEGMENT] __attribute__((aligned(64)));
    float run_max[MAX_QUERIES], run_sum[MAX_QUERIES];
    const float *krow[MAX_SEGMENT], *vrow[MAX_SEGMENT];
    int32_t lo[MAX_RUN_ROWS], hi[MAX_RUN_ROWS];
    int_vec lane;
    for (int i = 0; i < LANES; i++) lane[i] = i;
    for (int64_t m = 0; m < M; m++) {
        const int64_t j = m / group, g = m % group;
        const char *src = a->q + (a->q_rows[run->row + j] * a->q_stride + (h * group + g) * D) * elem;
        for (int64_t c = 0; c < nc; c++) {
            store_floats(q + m * D + c * LANES, load_vec(src + c * LANES * elem, bf16 ? BF16 : F32) * (a->scale * a->k_scale));
            store_floats(o + m * D + c * LANES, (vec){0});
        }
        run_max[m] = -FLT_MAX;
        run_sum[m] = 0.0f;
    }
    for (int64_t j = 0; j < run->rows; j++) {
        lo[j] = (int32_t)first_key(a, run->row + j);
        hi[j] = (int32_t)a->seq_lens[run->row + j];
    }
    /* The walk: block b of the table, slot `slot` in it. Blocks lie at random places, each pages away
     * from the last: every one would start with a row of cache misses before the hardware prefetcher
     * catches on. The blocks up to L2_AHEAD ahead are requested (all of them at the start). */
    int64_t b = k_begin / bs, slot = k_begin % bs;
    const int64_t b_end = (k_end + bs - 1) / bs;
    for (int64_t ahead = b + 1; ahead <= b + L2_AHEAD && ahead < b_end; ahead++)
        prefetch_block(a, table[ahead], h, bs * row_bytes);
    for (int64_t k0 = k_begin; k0 < k_end; k0 += seg) {
        const int64_t n = k_end - k0 < seg ? k_end - k0 : seg, padded = (n + LANES - 1) / LANES * LANES;
        /* The segment's key and value rows, widened to float once for every query vector (a float
         * cache's are read in place). */
        for (int64_t t = 0; t < n; t++) {
            const int64_t at = (((int64_t)table[b] * a->num_kv_heads + h) * bs + slot) * row_bytes;
            if (kv == F32) {
                krow[t] = (const float *)(a->k + at);
                vrow[t] = (const float *)(a->v + at);
            } else {
                widen_row(a->k + at, kf + t * D, D, kv);
                widen_row(a->v + at, vf + t * D, D, kv);
                krow[t] = kf + t * D;
                vrow[t] = vf + t * D;
            }
            if (++slot == bs) {
                slot = 0;
                if (++b + L2_AHEAD < b_end) prefetch_block(a, table[b + L2_AHEAD], h, bs * row_bytes);
            }
        }
        for (int64_t t = n; t < padded; t++) krow[t] = zero_row;
        for (int64_t m = 0; m < M; m++) {
            const int64_t j = m / group;
            const int32_t first = lo[j], end = hi[j] < k0 + n ? hi[j] : (int32_t)(k0 + n);
            const float *qm = q + m * D;
            /* Scores, LANES keys at a time (-FLT_MAX outside the row's keys), and their maximum. */
            vec top = (vec){0} - FLT_MAX;
            for (int64_t t0 = 0; t0 < padded; t0 += LANES) {
                /* The query is read per chunk as it is used: hoisted out of this loop it took a
                 * register per chunk and pushed the key accumulators onto the stack. */
                const float *qm_chunks = qm;
                __asm__("" : "+r"(qm_chunks));
                vec dots[LANES];
                for (int t = 0; t < LANES; t++) dots[t] = load_floats(qm_chunks) * load_floats(krow[t0 + t]);
                for (int64_t c = 1; c < nc; c++) {
                    const vec qc = load_floats(qm_chunks + c * LANES);
                    for (int t = 0; t < LANES; t++) dots[t] = fma_vec(qc, load_floats(krow[t0 + t] + c * LANES), dots[t]);
                }
                vec s = reduce_lanes(dots, 0);
                if (a->soft_cap > 0.0f) s = soft_cap_vec(s, a->soft_cap);
                const int_vec key = lane + (int32_t)(k0 + t0);
                s = select_vec((key >= first) & (key < end), s, (vec){0} - FLT_MAX);
                store_floats(p + t0, s);
                top = combine(top, s, 1);
            }
            /* One rescale to the new maximum, then the weights (0 outside the row's keys). */
            const float top1 = hmax(top), new_max = top1 > run_max[m] ? top1 : run_max[m];
            const float correction = exp_nonpositive(run_max[m] - new_max);
            vec sum = (vec){0};
            for (int64_t t0 = 0; t0 < padded; t0 += LANES) {
                const vec s = load_floats(p + t0);
                const vec w = select_vec(s > -FLT_MAX, exp_nonpositive_vec(s - new_max), (vec){0});
                store_floats(p + t0, w);
                sum += w;
            }
            run_max[m] = new_max;
            run_sum[m] = run_sum[m] * correction + hsum(sum);
            /* The value sums, VALUE_CHUNKS accumulators at a time in registers. Only the keys that
             * exist: a slot past the sequence may hold NaN, and 0 * NaN is NaN. */
            float *om = o + m * D;
            for (int64_t c0 = 0; c0 < nc; c0 += VALUE_CHUNKS) {
                const int64_t cn = nc - c0 < VALUE_CHUNKS ? nc - c0 : VALUE_CHUNKS;
                vec acc[VALUE_CHUNKS];
                for (int64_t c = 0; c < cn; c++) acc[c] = load_floats(om + (c0 + c) * LANES) * correction;
                for (int64_t t = 0; t < n; t++) {
                    const float w = p[t];
                    for (int64_t c = 0; c < cn; c++)
                        acc[c] = fma_vec((vec){0} + w, load_floats(vrow[t] + (c0 + c) * LANES), acc[c]);
                }
                for (int64_t c = 0; c < cn; c++) store_floats(om + (c0 + c) * LANES, acc[c]);
            }
        }
    }
    if (partial) {
        for (int64_t m = 0; m < M; m++) {
            float *state = partial + m * (2 + D);
            state[0] = run_max[m];
            state[1] = run_sum[m];
            memcpy(state + 2, o + m * D, D * sizeof(float));
        }
        return;
    }
    for (int64_t m = 0; m < M; m++) {
        const int64_t j = m / group, g = m % group;
        char *out = a->out + (a->q_rows[run->row + j] * a->out_stride + (h * group + g) * D) * elem;
        const float inv = run_sum[m] > 0.0f ? a->v_scale / run_sum[m] : 0.0f;
        for (int64_t c = 0; c < nc; c++) store_vec(out + c * LANES * elem, load_floats(o + m * D + c * LANES) * inv, bf16);
    }
}

/* Combines the `splits` partial states of each (run, kv head) into the final output; `stride`
 * floats from one work item's states to the next. */
static void merge_splits(const DecodeArgs *a, const Run *runs, int64_t tasks, int64_t splits, const float *scratch,
                         int64_t stride, int64_t head_size, int bf16) {
    const int64_t elem = bf16 ? 2 : 4, state = 2 + head_size, group = a->group;
#pragma omp parallel for
    for (int64_t task = 0; task < tasks; task++) {
        const Run *run = &runs[task / a->num_kv_heads];
        const int64_t h = task % a->num_kv_heads;
        for (int64_t m = 0; m < run->rows * group; m++) {
            const int64_t j = m / group, g = m % group;
            char *out = a->out + (a->q_rows[run->row + j] * a->out_stride + (h * group + g) * head_size) * elem;
            const float *first = scratch + task * splits * stride + m * state;
            float top = -FLT_MAX, sum = 0.0f, o[MAX_HEAD] = {0};
            for (int64_t i = 0; i < splits; i++) top = first[i * stride] > top ? first[i * stride] : top;
            for (int64_t i = 0; i < splits; i++) {
                const float *st = first + i * stride, w = exp_nonpositive(st[0] - top);
                sum += st[1] * w;
                for (int64_t d = 0; d < head_size; d++) o[d] += st[2 + d] * w;
            }
            const float inv = sum > 0.0f ? a->v_scale / sum : 0.0f;
            for (int64_t d = 0; d < head_size; d++) store_elem(out, d, o[d] * inv, bf16);
        }
    }
}

/* Splits per (run, kv head) so that every thread has work: a single long request would otherwise
 * leave a thread idle and read its keys at one core's share of the memory bandwidth. A split keeps
 * at least MIN_SPLIT_KEYS keys (and a whole block), below which merging costs more than it saves. */
#define MIN_SPLIT_KEYS 128
static int64_t num_splits(const DecodeArgs *a, const Run *runs, int64_t num_runs) {
#ifdef _OPENMP
    const int64_t threads = omp_get_max_threads();
#else
    const int64_t threads = 1;
#endif
    const int64_t tasks = num_runs * a->num_kv_heads, bs = a->block_size;
    if (tasks >= 2 * threads) return 1;
    int64_t max_blocks = 0;
    for (int64_t r = 0; r < num_runs; r++) {
        const int64_t blocks = (runs[r].k_end + bs - 1) / bs - runs[r].k_begin / bs;
        max_blocks = blocks > max_blocks ? blocks : max_blocks;
    }
    int64_t splits = (2 * threads + tasks - 1) / tasks;
    const int64_t by_keys = max_blocks * bs / MIN_SPLIT_KEYS;
    const int64_t most = by_keys < max_blocks ? by_keys : max_blocks;
    if (splits > most) splits = most;
    return splits > 1 ? splits : 1;
}

static int paged_decode(const DecodeArgs *a, int64_t num_rows, int64_t head_size, int bf16, int kv) {
    if (a->group > MAX_GROUP || head_size > MAX_HEAD || head_size % LANES) return -1;
    const int64_t nc = head_size / LANES, bs = a->block_size;
    int64_t most = QUERY_FLOATS / (head_size * a->group);
    most = most < MAX_RUN_ROWS ? most : MAX_RUN_ROWS;
    Run *runs = malloc((size_t)(num_rows > 0 ? num_rows : 1) * sizeof(Run));
    if (!runs) return -2;
    const int64_t num_runs = find_runs(a, num_rows, most, runs), tasks = num_runs * a->num_kv_heads;
    const int64_t splits = num_splits(a, runs, num_runs), stride = most * a->group * (2 + head_size);
    float *scratch = NULL;
    if (splits > 1) {
        scratch = malloc((size_t)(tasks * splits * stride) * sizeof(float));
        if (!scratch) {
            free(runs);
            return -2;
        }
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < tasks * splits; item++) {
        const int64_t task = item / splits, split = item % splits;
        const Run *run = &runs[task / a->num_kv_heads];
        const int64_t h = task % a->num_kv_heads;
        /* The split's blocks, and of them the run's keys. */
        const int64_t first = run->k_begin / bs, blocks = (run->k_end + bs - 1) / bs - first;
        int64_t k_begin = (first + blocks * split / splits) * bs, k_end = (first + blocks * (split + 1) / splits) * bs;
        k_begin = k_begin > run->k_begin ? k_begin : run->k_begin;
        k_end = k_end < run->k_end ? k_end : run->k_end;
        float *partial = scratch ? scratch + item * stride : NULL;
        /* Copies for the common head sizes (64, 128) and each cache type: with the head size a
         * constant its loops unroll and the accumulators stay in registers. */
#define TASK(NC, KV) decode_task(a, run, h, k_begin, k_end, partial, NC, bf16, KV)
#define TASKS(KV)                 \
    if (nc == 64 / LANES)         \
        TASK(64 / LANES, KV);     \
    else if (nc == 128 / LANES)   \
        TASK(128 / LANES, KV);    \
    else                          \
        TASK(nc, KV);
        if (kv == E4M3) {
            TASKS(E4M3)
        } else if (kv == E5M2) {
            TASKS(E5M2)
        } else if (kv == BF16) {
            TASKS(BF16)
        } else {
            TASKS(F32)
        }
#undef TASKS
#undef TASK
    }
    if (scratch) {
        merge_splits(a, runs, tasks, splits, scratch, stride, head_size, bf16);
        free(scratch);
    }
    free(runs);
    return 0;
}

/* Writes token i's keys and values (rows of `key`/`value`, [n, num_kv_heads, head_size] with row
 * strides, of the activations' type) into cache slot slots[i]: block slots[i] / block_size, offset
 * slots[i] % block_size. A cache of another type (`kv`: fp8) stores each element / its scale. */
static void write_kv(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                     char *k_cache, char *v_cache, const int64_t *slots, int64_t n, int64_t num_kv_heads,
                     int64_t block_size, int64_t head_size, int bf16, int kv, float k_scale, float v_scale) {
    const int64_t elem = bf16 ? 2 : 4, kv_elem = ELEM_SIZE(kv);
    const size_t row = (size_t)(head_size * elem);
#pragma omp parallel for if (n * num_kv_heads * head_size > 1 << 16)
    for (int64_t i = 0; i < n; i++) {
        const int64_t block = slots[i] / block_size, offset = slots[i] % block_size;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * head_size * kv_elem;
            const char *k_row = key + (i * key_stride + h * head_size) * elem;
            const char *v_row = value + (i * value_stride + h * head_size) * elem;
            if (kv == E4M3 || kv == E5M2) {
                for (int64_t d = 0; d < head_size; d++) {
                    ((uint8_t *)k_cache)[dst + d] = float_to_fp8(load_elem(k_row, d, bf16) / k_scale, kv);
                    ((uint8_t *)v_cache)[dst + d] = float_to_fp8(load_elem(v_row, d, bf16) / v_scale, kv);
                }
            } else {
                memcpy(k_cache + dst, k_row, row);
                memcpy(v_cache + dst, v_row, row);
            }
        }
    }
}

/* The cache type the exported functions take (`LayerArgs.cache_type`, `write_kv_*`'s `kv`) must be
 * the activations' own or fp8; `kv_scales` is the layer's [k_scale, v_scale] (NULL: 1). */
INLINE int cache_type_ok(int bf16, int64_t kv) { return kv == (bf16 ? BF16 : F32) || kv == E4M3 || kv == E5M2; }

#define EXPORT_WRITE(NAME, BF16)                                                                              \
    int NAME(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,     \
             void *v_cache, const int64_t *slots, int64_t n, int64_t num_kv_heads, int64_t block_size,        \
             int64_t head_size, int64_t kv, const float *kv_scales) {                                        \
        if (!cache_type_ok(BF16, kv)) return -1;                                                              \
        write_kv(key, key_stride, value, value_stride, k_cache, v_cache, slots, n, num_kv_heads, block_size,  \
                 head_size, BF16, (int)kv, kv_scales ? kv_scales[0] : 1.0f, kv_scales ? kv_scales[1] : 1.0f); \
        return 0;                                                                                             \
    }

EXPORT_WRITE(write_kv_f32, 0)
EXPORT_WRITE(write_kv_bf16, 1)

EXPORT_SIZE(StepArgs)
EXPORT_SIZE(LayerArgs)

/* One layer's decode attention: stores the step's new keys and values (if num_slots), then attends
 * each decode request's query row. The cache is [2, num_blocks, num_kv_heads, block_size, head] of
 * l->cache_type; `kv_scales` its [k_scale, v_scale] (NULL: 1). */
static int attend_layer(const void *q, int64_t q_stride, const void *key, int64_t key_stride, const void *value,
                        int64_t value_stride, void *cache, const float *kv_scales, void *out, int64_t out_stride,
                        const StepArgs *s, const LayerArgs *l, int bf16) {
    if (!cache_type_ok(bf16, l->cache_type)) return -1;
    const int kv = (int)l->cache_type;
    const float k_scale = kv_scales ? kv_scales[0] : 1.0f, v_scale = kv_scales ? kv_scales[1] : 1.0f;
    char *k_cache = cache, *v_cache = (char *)cache + l->v_offset * ELEM_SIZE(kv);
    if (s->num_slots)
        write_kv(key, key_stride, value, value_stride, k_cache, v_cache, s->slots, s->num_slots, l->num_kv_heads,
                 l->block_size, l->head_size, bf16, kv, k_scale, v_scale);
    const float load_scale = kv == E4M3 || kv == E5M2 ? FP8_LOAD_SCALE(kv) : 1.0f;
    const DecodeArgs a = {q, k_cache, v_cache, out, s->tables, s->q_rows, s->table_rows, s->seq_lens,
                          q_stride, out_stride, s->table_stride, l->num_kv_heads, l->num_heads / l->num_kv_heads,
                          l->block_size, l->window, l->scale, l->soft_cap, k_scale * load_scale,
                          v_scale * load_scale};
    return paged_decode(&a, s->num_reqs, l->head_size, bf16, kv);
}

#define EXPORT(NAME, BF16)                                                                            \
    int NAME(const void *q, int64_t q_stride, const void *key, int64_t key_stride, const void *value, \
             int64_t value_stride, void *cache, const float *kv_scales, void *out, int64_t out_stride,  \
             const StepArgs *s, const LayerArgs *l) {                                                 \
        return attend_layer(q, q_stride, key, key_stride, value, value_stride, cache, kv_scales, out,  \
                            out_stride, s, l, BF16);                                                  \
    }

EXPORT(decode_layer_f32, 0)
EXPORT(decode_layer_bf16, 1)
