/* Paged decode attention for CPUs: each decode row (one query token) attends to its keys straight from
 * the paged cache, with no gathered copy of the keys or values. A request verifying draft tokens has
 * one row per new token, each with its own length (its position + 1) over the request's block table.
 *
 * Built at run time by cpu_decode.py with the system C compiler (the one torch.compile's Inductor
 * uses on CPU) and loaded with ctypes. It links the OpenMP runtime torch has already loaded, so it
 * shares torch's threads instead of adding a second pool on the same cores.
 *
 * Layouts (element strides, contiguous unless a stride is passed):
 *   q        [rows, num_heads, head_size], row stride q_stride (a view of the fused QKV output)
 *   k, v     [num_blocks, num_kv_heads, block_size, head_size]
 *   tables   int32 [*, table_stride]: cache block ids of each request
 *   out      [rows, num_heads, head_size], row stride out_stride
 * Decode row i reads query row q_rows[i], block-table row table_rows[i], seq_lens[i] keys (the last
 * `window` of them, if window > 0; scores soft-capped if soft_cap > 0), and writes output row q_rows[i].
 *
 * Work item = (request, kv head, part of its blocks): each key and value is read from memory once and
 * serves every query head of the group. Softmax is online per segment of up to 256 keys (flash
 * decoding): the segment's scores, 16 keys to a vector, then one rescale of the accumulators and the
 * value sums. The body is written once for float and bfloat16 elements; the common head sizes (and
 * in bfloat16 the common group sizes) get their own constant-size copies, which the compiler keeps in
 * vector registers.
 *
 * The cache holds the activations' type, or fp8 (e4m3 or e5m2: a quarter / half the bytes to read)
 * storing x / scale with one key and one value scale per layer: the key scale is folded into the
 * query, the value scale into the output, so an fp8 element costs only its widening to float.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_GROUP 16
#define MAX_HEAD 256
#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                          /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* Element types: of the activations (F32 or BF16) and of the cache (any). */
enum { F32 = 0, BF16 = 1, E4M3 = 2, E5M2 = 3 };
#define ELEM_SIZE(type) ((type) == F32 ? 4 : (type) == BF16 ? 2 : 1)

/* fp8 formats as (mantissa bits, exponent bias, largest finite value). An fp8 magnitude's bits
 * shifted to a float's top bits (below the sign) are that float's exponent and mantissa with the
 * float's bias (127): multiplying by 2^(bias - 127) corrects it, subnormals included (they land on
 * float subnormals). */
#define FP8_MANT(type) ((type) == E4M3 ? 3 : 2)
#define FP8_BIAS(type) ((type) == E4M3 ? 7 : 15)
#define FP8_MAX(type) ((type) == E4M3 ? 448.0f : 57344.0f)

INLINE float pow2(int e) {
    const uint32_t bits = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* x in fp8 `type`: saturated to the largest finite value, rounded to nearest even. */
INLINE uint8_t float_to_fp8(float x, int type) {
    const int shift = 23 - FP8_MANT(type);
    float a = fabsf(x);
    a = a < FP8_MAX(type) ? a : FP8_MAX(type); /* also NaN -> the largest value */
    a *= pow2(FP8_BIAS(type) - 127); /* the reverse of load_vec's scaling */
    uint32_t u;
    memcpy(&u, &a, sizeof u);
    u += ((1u << shift) >> 1) - 1 + ((u >> shift) & 1u);
    return (uint8_t)((u >> shift) | (signbit(x) ? 0x80u : 0u));
}

/* 16 floats: one AVX-512 register; the compiler splits it on narrower vector units. */
typedef float vec __attribute__((vector_size(64)));
typedef uint16_t bf16_vec __attribute__((vector_size(32)));
typedef uint8_t byte_vec __attribute__((vector_size(16)));
typedef uint32_t word_vec __attribute__((vector_size(64)));
#define LANES 16
#define MAX_CHUNKS (MAX_HEAD / LANES)

/* 16 elements at `p` of `type` as floats (fp8 ones unscaled). */
INLINE vec load_vec(const char *p, int type) {
    vec f;
    if (type == E4M3 || type == E5M2) {
        byte_vec b;
        memcpy(&b, p, sizeof b);
        const word_vec w = __builtin_convertvector(b, word_vec);
        const word_vec bits = ((w & 0x7fu) << (23 - FP8_MANT(type))) | ((w & 0x80u) << 24);
        memcpy(&f, &bits, sizeof f);
        f *= pow2(127 - FP8_BIAS(type));
    } else if (type == BF16) {
#ifdef __AVX512F__
        /* One widening load; the generic conversion below compiles to two half-width ones and an
         * insert, which dominated the kernel's time. */
        const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
        bf16_vec h;
        memcpy(&h, p, sizeof h);
        const word_vec w = __builtin_convertvector(h, word_vec) << 16;
#endif
        memcpy(&f, &w, sizeof f);
    } else {
        memcpy(&f, p, sizeof f);
    }
    return f;
}

INLINE float hsum(vec x) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += x[i]; /* a tree of shuffles under -fassociative-math */
    return s;
}

/* e^x for x <= 0 (scores minus their running max), vectorizable unlike libm's expf: 2^n * p(f) with
 * x = n ln2 + f, |f| <= ln2/2, p a degree-6 Taylor polynomial (relative error < 2e-7). Inputs below
 * -87 (including the first block's -FLT_MAX running max) give ~0. */
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    /* Round x log2(e) to an integer: truncating y - 0.5 (y <= 0) rounds to nearest, bar ties. */
    const int32_t n = (int32_t)(x * 1.44269504f - 0.5f);
    const float f = x - (float)n * 0.693145752f - (float)n * 1.42860677e-6f;
    float p = 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    const int32_t bits = (n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

typedef struct {
    const char *q, *k, *v;
    char *out;
    const int32_t *tables;
    const int64_t *q_rows, *table_rows, *seq_lens;
    int64_t q_stride, out_stride, table_stride, num_kv_heads, group, block_size, window;
    float scale;
    float soft_cap; /* 0: none */
    float k_scale, v_scale; /* of an fp8 cache; 1 otherwise */
} DecodeArgs;

INLINE void store_row(char *out, int64_t d, float x, int bf16) {
    if (bf16)
        ((uint16_t *)out)[d] = float_to_bf16(x);
    else
        ((float *)out)[d] = x;
}

/* Keys [start, len) of request r (a sliding window starts past 0). */
INLINE int64_t first_key(const DecodeArgs *a, int64_t r) {
    const int64_t len = a->seq_lens[r];
    return (a->window > 0 && len > a->window) ? len - a->window : 0;
}

/* How many of block b's slots hold request r's keys (all of them but in its last block). */
INLINE int64_t keys_in_block(const DecodeArgs *a, int64_t r, int64_t b) {
    const int64_t rest = a->seq_lens[r] - b * a->block_size;
    return rest < a->block_size ? rest : a->block_size;
}

/* Cache blocks [*first, *end) of request r's table that hold its keys [first_key, len). */
INLINE void key_blocks(const DecodeArgs *a, int64_t r, int64_t *first, int64_t *end) {
    *first = first_key(a, r) / a->block_size;
    *end = (a->seq_lens[r] + a->block_size - 1) / a->block_size;
}

typedef int32_t int_vec __attribute__((vector_size(64)));

/* Lanes of `a` where `mask` is set, of `b` elsewhere. */
INLINE vec select_vec(int_vec mask, vec a, vec b) {
    return (vec)(((int_vec)a & mask) | ((int_vec)b & ~mask));
}

/* a + b, or with `max` the larger of each lane. */
INLINE vec combine(vec a, vec b, const int max) {
    return max ? select_vec(a > b, a, b) : a + b;
}

/* Lane i of the result: the sum (with `max`, the largest) of v[i]'s lanes. A transpose tree (each
 * level combines the two halves of pairs of vectors, interleaved so the last level leaves the
 * results in order) costs 15 two-shuffle steps for 16 results instead of 16 horizontal reductions
 * of 4 shuffles and 4 operations each. */
INLINE vec reduce_lanes16(const vec *v, const int max) {
    vec r1[8], r2[4], r3[2];
    for (int i = 0; i < 8; i++)
        r1[i] = combine(__builtin_shuffle(v[i], v[i + 8], (int_vec){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}),
                        __builtin_shuffle(v[i], v[i + 8], (int_vec){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}),
                        max);
    for (int i = 0; i < 4; i++)
        r2[i] = combine(__builtin_shuffle(r1[i], r1[i + 4], (int_vec){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}),
                        __builtin_shuffle(r1[i], r1[i + 4], (int_vec){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}),
                        max);
    for (int i = 0; i < 2; i++)
        r3[i] = combine(__builtin_shuffle(r2[i], r2[i + 2], (int_vec){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}),
                        __builtin_shuffle(r2[i], r2[i + 2], (int_vec){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}),
                        max);
    return combine(__builtin_shuffle(r3[0], r3[1], (int_vec){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}),
                   __builtin_shuffle(r3[0], r3[1], (int_vec){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}),
                   max);
}

INLINE float hmax(vec x) {
    float m = x[0];
    for (int i = 1; i < LANES; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* exp_nonpositive on 16 lanes at once (the same steps in vector operations). */
INLINE vec exp_nonpositive_vec(vec x) {
    x = select_vec(x < -87.0f, (vec){0} - 87.0f, x);
    const int_vec n = __builtin_convertvector(x * 1.44269504f - 0.5f, int_vec);
    const vec nf = __builtin_convertvector(n, vec);
    const vec f = x - nf * 0.693145752f - nf * 1.42860677e-6f;
    vec p = f * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    return p * (vec)((n + 127) << 23);
}

/* Gemma-2's logit soft cap, cap * tanh(s / cap), on 16 scores. tanh(|y|) = (1 - t) / (1 + t) with
 * t = e^(-2|y|) <= 1, so exp_nonpositive_vec serves; the absolute error stays ~cap * 1e-7. */
INLINE vec soft_cap_vec(vec s, float cap) {
    const vec y = s * (1.0f / cap);
    const vec t = exp_nonpositive_vec(select_vec(y < 0.0f, y, -y) * 2.0f);
    const vec th = (1.0f - t) / (1.0f + t);
    return select_vec(y < 0.0f, -th, th) * cap;
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

/* Attention of request r's query heads of kv head h over cache blocks [b_begin, b_end) of its table.
 * With `partial` NULL the result is final and goes to `out`; otherwise the unnormalized state
 * (running max, sum, weighted values: group x (2 + D) floats) goes there for merge_splits. `nc` is
 * the head size in 16-float chunks, a compile-time constant in the specialized copies; `bf16`
 * selects the activations' element type, `kv` the cache's.
 *
 * Keys go in segments of up to SEGMENT_CHUNKS x 16, each in two passes: all the segment's scores
 * first (keys 16 at a time: each key row converted once for all query heads of the group, a head's 16
 * scores out of one transpose-sum as a vector), then one rescale to the segment's maximum and the
 * value sums. Rescaling every 16 keys instead put a chain of horizontal maximum, scalar exponential
 * and rescale between each 16 keys' scores and their value sums, which the core could not overlap. */
#define SEGMENT_CHUNKS 16
INLINE void decode_task(const DecodeArgs *a, int64_t r, int64_t h, int64_t b_begin, int64_t b_end,
                        float *partial, const int64_t nc, const int64_t group, const int bf16, const int kv) {
    const int64_t elem = bf16 ? 2 : 4, kv_elem = ELEM_SIZE(kv), D = nc * LANES;
    const int64_t bs = a->block_size, start = first_key(a, r);
    const int32_t *table = a->tables + a->table_rows[r] * a->table_stride;
    vec qv[MAX_GROUP][MAX_CHUNKS], acc[MAX_GROUP][MAX_CHUNKS], dots[MAX_GROUP][LANES];
    vec scores[MAX_GROUP][SEGMENT_CHUNKS];
    float run_max[MAX_GROUP], run_sum[MAX_GROUP];
    int64_t chunk_offset[SEGMENT_CHUNKS], chunk_keys[SEGMENT_CHUNKS]; /* bytes into k and v; keys */
    const int_vec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const char *qr = a->q + (a->q_rows[r] * a->q_stride + h * group * D) * elem;
    for (int64_t g = 0; g < group; g++) {
        for (int64_t c = 0; c < nc; c++) {
            qv[g][c] = load_vec(qr + (g * D + c * LANES) * elem, bf16) * (a->scale * a->k_scale);
            acc[g][c] = (vec){0};
        }
        run_max[g] = -FLT_MAX;
        run_sum[g] = 0.0f;
    }
    /* The walk: block b, its keys [c0, t1). */
    int64_t b = b_begin, c0 = start > b * bs ? start - b * bs : 0, t1 = keys_in_block(a, r, b);
    for (int64_t ahead = b + 1; ahead <= b + L2_AHEAD && ahead < b_end; ahead++)
        prefetch_block(a, table[ahead], h, bs * D * kv_elem);
    while (b < b_end) {
        int64_t chunks = 0;
        for (; chunks < SEGMENT_CHUNKS && b < b_end; chunks++) {
            chunk_offset[chunks] = (((int64_t)table[b] * a->num_kv_heads + h) * bs + c0) * D * kv_elem;
            chunk_keys[chunks] = t1 - c0 < LANES ? t1 - c0 : LANES;
            c0 += LANES;
            if (c0 >= t1) {
                /* Blocks lie at random places, each pages away from the last: every one would
                 * start with a row of cache misses before the hardware prefetcher catches on. The
                 * blocks up to L2_AHEAD ahead are requested (all of them at the start). */
                if (++b + L2_AHEAD < b_end) prefetch_block(a, table[b + L2_AHEAD], h, bs * D * kv_elem);
                c0 = 0;
                t1 = keys_in_block(a, r, b);
            }
        }
        /* Pass 1: scores (-FLT_MAX past the keys) and their lane-wise maxima. */
        vec seg_max[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) seg_max[g] = (vec){0} - FLT_MAX;
        for (int64_t ch = 0; ch < chunks; ch++) {
            const char *kb = a->k + chunk_offset[ch];
            const int64_t n = chunk_keys[ch];
            for (int64_t t = 0; t < LANES; t++) {
                if (t < n) {
                    vec key[MAX_CHUNKS];
                    for (int64_t c = 0; c < nc; c++) key[c] = load_vec(kb + (t * D + c * LANES) * kv_elem, kv);
                    for (int64_t g = 0; g < group; g++) {
                        vec dot = qv[g][0] * key[0];
                        for (int64_t c = 1; c < nc; c++) dot += qv[g][c] * key[c];
                        dots[g][t] = dot;
                    }
                } else {
                    for (int64_t g = 0; g < group; g++) dots[g][t] = (vec){0};
                }
            }
            const int_vec valid = lane < (int32_t)n;
            for (int64_t g = 0; g < group; g++) {
                vec s = reduce_lanes16(dots[g], 0);
                if (a->soft_cap > 0.0f) s = soft_cap_vec(s, a->soft_cap);
                scores[g][ch] = select_vec(valid, s, (vec){0} - FLT_MAX);
                seg_max[g] = combine(seg_max[g], scores[g][ch], 1);
            }
        }
        /* Pass 2: one rescale to the new maximum, then the weights and the value sums. */
        vec seg_sum[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) {
            const float top = hmax(seg_max[g]);
            const float m = top > run_max[g] ? top : run_max[g];
            const float correction = exp_nonpositive(run_max[g] - m);
            run_max[g] = m;
            run_sum[g] *= correction;
            for (int64_t c = 0; c < nc; c++) acc[g][c] *= correction;
            seg_sum[g] = (vec){0};
        }
        for (int64_t ch = 0; ch < chunks; ch++) {
            const char *vb = a->v + chunk_offset[ch];
            const int64_t n = chunk_keys[ch];
            vec p[MAX_GROUP];
            for (int64_t g = 0; g < group; g++) {
                p[g] = select_vec(lane < (int32_t)n, exp_nonpositive_vec(scores[g][ch] - run_max[g]), (vec){0});
                seg_sum[g] += p[g];
            }
            /* Only the keys that exist: a slot past the sequence may hold NaN, and 0 * NaN is NaN.
             * Each value row is converted once for all heads of the group (whose accumulators stay
             * in registers where the group size is a compile-time constant). */
            for (int64_t t = 0; t < n; t++) {
                vec value[MAX_CHUNKS];
                for (int64_t c = 0; c < nc; c++) value[c] = load_vec(vb + (t * D + c * LANES) * kv_elem, kv);
                for (int64_t g = 0; g < group; g++)
                    for (int64_t c = 0; c < nc; c++) acc[g][c] += p[g][t] * value[c];
            }
        }
        for (int64_t g = 0; g < group; g++) run_sum[g] += hsum(seg_sum[g]);
    }
    if (partial) {
        for (int64_t g = 0; g < group; g++) {
            float *state = partial + g * (2 + D);
            state[0] = run_max[g];
            state[1] = run_sum[g];
            for (int64_t c = 0; c < nc; c++) memcpy(state + 2 + c * LANES, &acc[g][c], sizeof(vec));
        }
        return;
    }
    char *out = a->out + (a->q_rows[r] * a->out_stride + h * group * D) * elem;
    for (int64_t g = 0; g < group; g++) {
        const float inv = run_sum[g] > 0.0f ? a->v_scale / run_sum[g] : 0.0f;
        for (int64_t c = 0; c < nc; c++) {
            const vec x = acc[g][c] * inv;
            for (int64_t i = 0; i < LANES; i++) store_row(out, g * D + c * LANES + i, x[i], bf16);
        }
    }
}

/* Combines the `splits` partial states of each (request, kv head) into the final output. */
static void merge_splits(const DecodeArgs *a, int64_t tasks, int64_t splits, const float *scratch,
                         int64_t head_size, int bf16) {
    const int64_t elem = bf16 ? 2 : 4, state = 2 + head_size;
#pragma omp parallel for
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t r = task / a->num_kv_heads, h = task % a->num_kv_heads;
        char *out = a->out + (a->q_rows[r] * a->out_stride + h * a->group * head_size) * elem;
        for (int64_t g = 0; g < a->group; g++) {
            const float *first = scratch + (task * splits * a->group + g) * state;
            const int64_t stride = a->group * state; /* from one split's state to the next */
            float m = -FLT_MAX, sum = 0.0f, o[MAX_HEAD] = {0};
            for (int64_t i = 0; i < splits; i++) m = first[i * stride] > m ? first[i * stride] : m;
            for (int64_t i = 0; i < splits; i++) {
                const float *st = first + i * stride, w = exp_nonpositive(st[0] - m);
                sum += st[1] * w;
                for (int64_t d = 0; d < head_size; d++) o[d] += st[2 + d] * w;
            }
            const float inv = sum > 0.0f ? a->v_scale / sum : 0.0f;
            for (int64_t d = 0; d < head_size; d++) store_row(out, g * head_size + d, o[d] * inv, bf16);
        }
    }
}

/* Splits per (request, kv head) so that every thread has work: a single long request would otherwise
 * leave a thread idle and read its keys at one core's share of the memory bandwidth. A split keeps
 * at least MIN_SPLIT_KEYS keys (and a whole block), below which merging costs more than it saves. */
#define MIN_SPLIT_KEYS 128
static int64_t num_splits(const DecodeArgs *a, int64_t num_reqs) {
#ifdef _OPENMP
    const int64_t threads = omp_get_max_threads();
#else
    const int64_t threads = 1;
#endif
    const int64_t tasks = num_reqs * a->num_kv_heads;
    if (tasks >= 2 * threads) return 1;
    int64_t max_blocks = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        int64_t first, end;
        key_blocks(a, r, &first, &end);
        max_blocks = end - first > max_blocks ? end - first : max_blocks;
    }
    int64_t splits = (2 * threads + tasks - 1) / tasks;
    const int64_t by_keys = max_blocks * a->block_size / MIN_SPLIT_KEYS;
    const int64_t most = by_keys < max_blocks ? by_keys : max_blocks;
    if (splits > most) splits = most;
    return splits > 1 ? splits : 1;
}

static int paged_decode(const DecodeArgs *a, int64_t num_reqs, int64_t head_size, int bf16, int kv) {
    if (a->group > MAX_GROUP || head_size > MAX_HEAD || head_size % LANES)
        return -1;
    const int64_t nc = head_size / LANES, tasks = num_reqs * a->num_kv_heads;
    const int64_t splits = num_splits(a, num_reqs);
    float *scratch = NULL;
    if (splits > 1) {
        scratch = malloc((size_t)(tasks * splits * a->group * (2 + head_size)) * sizeof(float));
        if (!scratch) return -2;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < tasks * splits; item++) {
        const int64_t task = item / splits, split = item % splits;
        const int64_t r = task / a->num_kv_heads, h = task % a->num_kv_heads;
        int64_t first, end;
        key_blocks(a, r, &first, &end);
        const int64_t b_begin = first + (end - first) * split / splits;
        const int64_t b_end = first + (end - first) * (split + 1) / splits;
        float *partial = scratch ? scratch + item * a->group * (2 + head_size) : NULL;
        /* Copies for the common head sizes, and in bfloat16 for the common groups: with both
         * constant a group's accumulators stay in vector registers (7-11% here on SmolLM2's 3).
         * Each cache type gets its own copies (kv is a constant in them). */
#define TASK(NC, GROUP, KV) decode_task(a, r, h, b_begin, b_end, partial, NC, GROUP, bf16, KV)
#define TASKS(KV)                                                                                           \
    if (bf16 && nc == 4 && group <= 4)                                                                      \
        group == 1 ? TASK(4, 1, KV) : group == 2 ? TASK(4, 2, KV) : group == 3 ? TASK(4, 3, KV) : TASK(4, 4, KV); \
    else if (bf16 && nc == 8 && group <= 4)                                                                 \
        group == 1 ? TASK(8, 1, KV) : group == 2 ? TASK(8, 2, KV) : group == 3 ? TASK(8, 3, KV) : TASK(8, 4, KV); \
    else if (nc == 4)                                                                                       \
        TASK(4, group, KV);                                                                                 \
    else if (nc == 8)                                                                                       \
        TASK(8, group, KV);                                                                                 \
    else                                                                                                    \
        TASK(nc, group, KV);
        const int64_t group = a->group;
        if (kv == E4M3) {
            TASKS(E4M3)
        } else if (kv == E5M2) {
            TASKS(E5M2)
        } else if (bf16) {
            TASKS(BF16)
        } else {
            TASKS(F32)
        }
#undef TASKS
#undef TASK
    }
    if (scratch) {
        merge_splits(a, tasks, splits, scratch, head_size, bf16);
        free(scratch);
    }
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
                    const float x = bf16 ? bf16_to_float(((const uint16_t *)k_row)[d]) : ((const float *)k_row)[d];
                    const float y = bf16 ? bf16_to_float(((const uint16_t *)v_row)[d]) : ((const float *)v_row)[d];
                    ((uint8_t *)k_cache)[dst + d] = float_to_fp8(x / k_scale, kv);
                    ((uint8_t *)v_cache)[dst + d] = float_to_fp8(y / v_scale, kv);
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

/* What a decode call needs from the step (the same for every layer), and from the layer's head
 * layout (the same for every layer of that layout): built once by the caller, passed by pointer, so
 * a layer's call converts only its own tensors' addresses. */
typedef struct {
    const int32_t *tables;
    int64_t table_stride;
    const int64_t *q_rows, *table_rows, *seq_lens;
    int64_t num_reqs;
    const int64_t *slots; /* cache slot of each of the step's num_slots new tokens */
    int64_t num_slots;    /* 0: the keys were written already (a step with prompts writes first) */
} StepArgs;

typedef struct {
    int64_t num_heads, num_kv_heads, head_size, block_size;
    int64_t v_offset; /* elements from the key half of a layer's cache to its value half */
    float scale;
    int64_t window;
    float soft_cap;     /* logits soft cap (Gemma-2), 0: none */
    int64_t cache_type; /* F32, BF16, E4M3 or E5M2 */
} LayerArgs;

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
    const DecodeArgs a = {q, k_cache, v_cache, out, s->tables, s->q_rows, s->table_rows, s->seq_lens,
                          q_stride, out_stride, s->table_stride, l->num_kv_heads, l->num_heads / l->num_kv_heads,
                          l->block_size, l->window, l->scale, l->soft_cap, k_scale, v_scale};
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
