/* GGUF (llama.cpp) block-quantized linear layers computed from the blocks as stored.
 *
 * A decode step is bound by reading the weights: the products here read each quantized block once
 * and never widen a weight to float in memory. As llama.cpp does, the activations are quantized to
 * int8 per 32-element block (one float scale each, plus the integer sums of each 16-element half,
 * which the types with minimums need), and each weight block is unpacked to bytes with one
 * scale and one minimum per 16 elements (gguf_blocks.h), so every type is an integer dot product of
 * 32 bytes:
 *
 *     sum_j w_j a_j = da * sum_{h in halves} (scale_h * sum_{j in h} q_j a_j  -  min_h * sum_{j in h} a_j)
 *
 * Paths: AVX2, whose u8 x s8 multiply-adds become one `vpdpbusd` where the CPU has AVX-512 VNNI
 * (compiled only then, by -march=native), and portable C that is only slower (tests build it without
 * -march=native and compare). The per-block loops are specialized per type
 * (`for_each_type`), so the type switches fold away inside them.
 * F32/F16/BF16 weights are multiplied in float (no activation quantization).
 *
 * Also: rows dequantized to float32 or bfloat16 (the batched path's tiles, the embedding's gather).
 * Products of many bf16 rows on AVX512-BF16 CPUs: gguf_panels.c.
 * Built by kernels/build.py into the gguf kernel library; bindings: layers/quant/gguf_native.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "gguf_blocks.h"

/* Bytes of a row of k elements of type t; 0 where k is not whole blocks or t unknown. */
int64_t gguf_row_bytes(int t, int64_t k) {
    int64_t e = block_elems(t);
    return e && k % e == 0 ? k / e * block_bytes(t) : 0;
}

/* Rows ids[0..n) (or 0..n when ids is NULL) of a [nrows, k] weight of type t, dequantized to out
 * [n, k] (bfloat16 when out_bf16). Returns -1 for an unknown type or a k that is not whole blocks,
 * -2 for an id outside [0, nrows).
 * One thread: a tile of the batched product is cheaper than waking a second one on a busy machine
 * (measured: tiles.py). */
int gguf_dequantize_rows(int t, const uint8_t *w, int64_t nrows, int64_t k, const int64_t *ids, int64_t n,
                         void *out, int out_bf16) {
    int64_t rb = gguf_row_bytes(t, k);
    if (!rb || (!is_float_type(t) && k % 32)) return -1;
    for (int64_t i = 0; ids && i < n; i++)
        if (ids[i] < 0 || ids[i] >= nrows) return -2;
    float *tmp = out_bf16 ? malloc(k * sizeof(float)) : NULL;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = w + (ids ? ids[i] : i) * rb;
        if (out_bf16) {
            dequant_row(t, row, k, tmp);
            for (int64_t c = 0; c < k; c++) ((uint16_t *)out)[i * k + c] = float_to_bf16(tmp[c]);
        } else {
            dequant_row(t, row, k, (float *)out + i * k);
        }
    }
    free(tmp);
    return 0;
}

/* Activations quantized per 32-element block: int8 values, the block's scale and the sum of each
 * 16-element half's values (integer sum times the scale: what the minimums multiply). */
typedef struct {
    int8_t *q;
    float *d;
    float *s16;
} QAct;

/* x's 32-element blocks as int8 q with scales d (amax / 127) and the scaled sums of each half s16. */
static void quantize_row(const float *x, int64_t k, int8_t *q, float *d, float *s16) {
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + 32 * b;
#ifdef __AVX2__
        /* The scalar loop's roundings, 32 lanes at once (cvtps rounds to nearest even as lrintf does;
         * values within +-127, so the packs never saturate and the half sums are exact in float): the
         * scalar loop took ~5 ns an element, a few us of every decode product. */
        __m256 v[4], m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
        float amax = 0.0f;
        for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(xb[l]));
#endif
        float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        d[b] = scale;
#ifdef __AVX2__
        __m256i iv[4];
        for (int j = 0; j < 4; j++) iv[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
        /* The packs interleave the 128-bit lanes; the permute puts the 32 bytes back in order. */
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
        _mm256_storeu_si256((__m256i *)(q + 32 * b),
                            _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        s16[2 * b] = scale * hsum8(_mm256_cvtepi32_ps(_mm256_add_epi32(iv[0], iv[1])));
        s16[2 * b + 1] = scale * hsum8(_mm256_cvtepi32_ps(_mm256_add_epi32(iv[2], iv[3])));
#else
        int32_t s0 = 0, s1 = 0;
        for (int l = 0; l < 32; l++) {
            int v = (int)lrintf(xb[l] * inv);
            q[32 * b + l] = (int8_t)v;
            if (l < 16) s0 += v; else s1 += v;
        }
        s16[2 * b] = scale * (float)s0;
        s16[2 * b + 1] = scale * (float)s1;
#endif
    }
}

#ifdef __AVX2__
/* Eight int32 sums of 4 products of unsigned u and signed s bytes each. */
INLINE __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

/* Activation rows dotted with each weight row in one pass: each block is unpacked once for all. */
#define DOT_ROWS 4

/* Whether both 16-element halves of a type's 32-element block share one scale (then one broadcast). */
INLINE int one_scale(int t) { return t != Q2_K && t != Q3_K && t != Q6_K; }

#ifdef __AVX2__
/* The block scale of each half times the activation block's scale, lanes 0-3 the first half's. */
INLINE __m256 half_scales(int t, const float *sc, float da) {
    return one_scale(t) ? _mm256_set1_ps(sc[0] * da) : _mm256_set_m128(_mm_set1_ps(sc[1] * da), _mm_set1_ps(sc[0] * da));
}
#endif

/* acc plus a block's minimum term mn_0 s0 + mn_1 s1 (s0, s1: the activation halves' scaled sums). The
 * 32-element types (one minimum a block) take it as one fused product of the summed halves, as
 * dot_weight_rows' vector lanes do: a one-row step and a several-row one must agree to the bit (a
 * last-bit difference can flip an activation's int8 rounding in a later layer). */
INLINE float add_minimum(int t, float acc, const float *mn, float s0, float s1) {
    return block_elems(t) == 32 ? fmaf(mn[0], s0 + s1, acc) : acc + mn[0] * s0 + mn[1] * s1;
}

/* sum_j w_j x_j of a quantized row (k elements) with each of `mr` (<= DOT_ROWS) quantized activation
 * rows (consecutive in aq, ad, as) into res[0..mr): per block,
 * da * sum_h sc_h * sum_{j in h} q_j a_j  -  sum_h mn_h * (da * sum_{j in h} a_j). */
INLINE void dot_blocks(int t, int mr, const uint8_t *row, int64_t k, const int8_t *aq, const float *ad,
                       const float *as, float *res) {
    int64_t nb = k / 32;
    float minimums[DOT_ROWS] = {0};
#ifdef __AVX2__
    __m256 acc[DOT_ROWS];
    for (int m = 0; m < mr; m++) acc[m] = _mm256_setzero_ps();
#else
    float total[DOT_ROWS] = {0};
#endif
    for (int64_t b = 0; b < nb; b++) {
        float sc[2], mn[2];
        block_scales(t, row, b, sc, mn);
#ifdef __AVX2__
        __m256i q = unpack_q8x32(t, row, b), uq = t == Q8_0 ? _mm256_sign_epi8(q, q) : q;
#else
        int8_t q[32];
        unpack_q(t, row, b, q);
#endif
        for (int m = 0; m < mr; m++) {
            float da = ad[m * nb + b];
            minimums[m] = add_minimum(t, minimums[m], mn, as[m * 2 * nb + 2 * b], as[m * 2 * nb + 2 * b + 1]);
#ifdef __AVX2__
            __m256i a = LOAD32(aq + m * k + 32 * b);
            /* Q8_0 is signed x signed: |w| times a with w's sign. */
            __m256i sums = dot_u8s8(uq, t == Q8_0 ? _mm256_sign_epi8(a, q) : a);
            /* Lanes 0-3 sum the first half's products, lanes 4-7 the second's. */
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), half_scales(t, sc, da), acc[m]);
#else
            const int8_t *a = aq + m * k + 32 * b;
            int32_t s0 = 0, s1 = 0;
            for (int l = 0; l < 16; l++) s0 += q[l] * a[l];
            for (int l = 16; l < 32; l++) s1 += q[l] * a[l];
            total[m] += da * (sc[0] * s0 + sc[1] * s1);
#endif
        }
    }
    for (int m = 0; m < mr; m++)
#ifdef __AVX2__
        res[m] = hsum8(acc[m]) - minimums[m];
#else
        res[m] = total[m] - minimums[m];
#endif
}

/* One activation row against WROWS consecutive weight rows (row stride rb) into res[0..WROWS): the
 * matrix-vector product of decode. Each activation block is loaded once for all the rows, and the rows'
 * accumulators are independent chains (one row at a time waits on its one FMA chain). */
#define WROWS 4
/* Bytes ahead of each row's block that are prefetched: the WROWS rows are as many streams per thread,
 * more than the hardware prefetcher follows well (figures: benchmarks/RESULTS.md, "Figures behind code
 * choices"). */
#define PREFETCH_AHEAD 1024
/* The byte offset from a row's start to prefetch while block b is read: PREFETCH_AHEAD further along
 * the row, and past its end the same place in the next unit's row (this thread's next rows; a plain
 * offset would land in the unit's own next row, already being read, and prefetch nothing ahead:
 * long rows then ran well below the rate of shorter ones). */
INLINE int64_t ahead_offset(int t, int64_t b, int64_t rb) {
    int64_t ahead = (block_elems(t) == 32 ? b : b / 8) * block_bytes(t) + PREFETCH_AHEAD;
    return ahead + (ahead >= rb ? (WROWS - 1) * rb : 0);
}
/* For the 32-element block types: the WROWS rows' block headers at byte offset `off` as one vector,
 * lanes 2i and 2i+1 the scale d and the minimum factor of row i (its float16 minimum m for Q4_1/Q5_1;
 * else d again, which the caller's factor turns into the type's implied minimum). One half-to-float
 * conversion serves all rows, where one scalar conversion per row and field took a quarter of a Q4
 * block's instructions. */
#ifdef __AVX2__
INLINE __m256 header_pairs(int t, const uint8_t *row0, int64_t rb, int64_t off) {
    int32_t h[WROWS];
    for (int i = 0; i < WROWS; i++) {
        uint16_t d[2];
        memcpy(d, row0 + i * rb + off, t == Q4_1 || t == Q5_1 ? 4 : 2);
        if (t != Q4_1 && t != Q5_1) d[1] = d[0];
        memcpy(&h[i], d, 4);
    }
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}
/* What a block's minimum lane is multiplied by, times the activation block's sum: value = d q - mn
 * with mn = -m (Q4_1, Q5_1), 8 d (Q4_0), 16 d (Q5_0), 0 (Q8_0). */
INLINE float minimum_factor(int t) {
    return t == Q4_1 || t == Q5_1 ? -1.0f : t == Q4_0 ? 8.0f : t == Q5_0 ? 16.0f : 0.0f;
}
#endif

INLINE void dot_weight_rows(int t, const uint8_t *row0, int64_t rb, int64_t k, const int8_t *aq, const float *ad,
                            const float *as, float *res) {
#ifdef __AVX2__
    int64_t nb = k / 32;
    __m256 acc[WROWS];
    float minimums[WROWS];
    for (int i = 0; i < WROWS; i++) {
        acc[i] = _mm256_setzero_ps();
        minimums[i] = 0.0f;
    }
    __m256 minimum_lanes = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i a = LOAD32(aq + 32 * b);
        float da = ad[b], s0 = as[2 * b], s1 = as[2 * b + 1];
        __m256 scaled = _mm256_setzero_ps();
        if (block_elems(t) == 32) {
            /* lanes 2i: d_i da (row i's scale of the products), 2i+1: mn_i (s0 + s1), summed below. */
            const float f = minimum_factor(t) * (s0 + s1);
            const __m256 factors = _mm256_setr_ps(da, f, da, f, da, f, da, f);
            const __m256 headers = header_pairs(t, row0, rb, b * block_bytes(t));
            scaled = _mm256_mul_ps(headers, factors);
            minimum_lanes = _mm256_fmadd_ps(headers, factors, minimum_lanes); /* as add_minimum */
        }
        for (int i = 0; i < WROWS; i++) {
            const uint8_t *row = row0 + i * rb;
            _mm_prefetch((const char *)(row + ahead_offset(t, b, rb)), _MM_HINT_T0);
            __m256i q = unpack_q8x32(t, row, b);
            __m256i sums = t == Q8_0 ? dot_u8s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q)) : dot_u8s8(q, a);
            __m256 scale;
            if (block_elems(t) == 32) {
                scale = _mm256_permutevar8x32_ps(scaled, _mm256_set1_epi32(2 * i));
            } else {
                float sc[2], mn[2];
                block_scales(t, row, b, sc, mn);
                scale = half_scales(t, sc, da);
                minimums[i] = add_minimum(t, minimums[i], mn, s0, s1);
            }
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[i]);
        }
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, minimum_lanes);
    for (int i = 0; i < WROWS; i++) res[i] = hsum8(acc[i]) - (block_elems(t) == 32 ? lanes[2 * i + 1] : minimums[i]);
#else
    for (int i = 0; i < WROWS; i++) dot_blocks(t, 1, row0 + i * rb, k, aq, ad, as, res + i);
#endif
}

static void dot_weight_rows_typed(int t, const uint8_t *row0, int64_t rb, int64_t k, const int8_t *aq,
                                  const float *ad, const float *as, float *res) {
#define DOTW(T) dot_weight_rows(T, row0, rb, k, aq, ad, as, res); return;
    for_each_type(t, DOTW)
#undef DOTW
}

/* dot_blocks specialized for each type and row count. */
static void dot_rows(int t, int mr, const uint8_t *row, int64_t k, const int8_t *aq, const float *ad,
                     const float *as, float *res) {
#define DOT(T)                                                            \
    switch (mr) {                                                         \
    case 1: dot_blocks(T, 1, row, k, aq, ad, as, res); return;            \
    case 2: dot_blocks(T, 2, row, k, aq, ad, as, res); return;            \
    case 3: dot_blocks(T, 3, row, k, aq, ad, as, res); return;            \
    default: dot_blocks(T, DOT_ROWS, row, k, aq, ad, as, res); return;    \
    }
    for_each_type(t, DOT)
#undef DOT
}

static float dot_float(const float *w, const float *x, int64_t k) {
    float s = 0.0f;
    for (int64_t i = 0; i < k; i++) s += w[i] * x[i];
    return s;
}

/* y[m, :] = x[m, :] @ W^T for m < M, where W is the row-concatenation of `nshards` weights (shard i:
 * rows[i] rows of type types[i] at w[i], k columns). x and y rows have strides ldx and ldy (elements),
 * bfloat16 where x_bf16 / y_bf16 else float32. Returns -1 for an unknown type or a k that is not whole
 * blocks of a shard's type. */
int gguf_matmul(int64_t nshards, const uint8_t *const *w, const int32_t *types, const int64_t *rows,
                int64_t k, const void *x, int64_t ldx, int x_bf16, int64_t M, void *y, int64_t ldy,
                int y_bf16) {
    int64_t total = 0, any_quant = 0, any_float = 0;
    for (int64_t s = 0; s < nshards; s++) {
        if (!gguf_row_bytes(types[s], k) || (!is_float_type(types[s]) && k % 32)) return -1;
        total += rows[s];
        if (is_float_type(types[s])) any_float = 1; else any_quant = 1;
    }
    /* x as float32 rows, then (for quantized shards) as int8 blocks. */
    float *xf = malloc(M * k * sizeof(float));
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < k; i++)
            xf[m * k + i] = load_elem(x, m * ldx + i, x_bf16);
    QAct a = {0};
    if (any_quant) {
        a.q = malloc(M * k);
        a.d = malloc(M * (k / 32) * sizeof(float));
        a.s16 = malloc(M * (k / 16) * sizeof(float));
        for (int64_t m = 0; m < M; m++)
            quantize_row(xf + m * k, k, a.q + m * k, a.d + m * (k / 32), a.s16 + m * (k / 16));
    }
#pragma omp parallel
    {
        float *wf = any_float ? malloc(k * sizeof(float)) : NULL;
        /* WROWS output rows a unit of work: one activation row takes them in one pass where they are
         * of one quantized shard, else (shard edges, float shards, several activation rows) row by row. */
#pragma omp for schedule(static)
        for (int64_t r0 = 0; r0 < total; r0 += WROWS) {
            int64_t s = 0, local = r0;
            while (local >= rows[s]) local -= rows[s++];
            int t = types[s];
            int64_t rb = gguf_row_bytes(t, k);
            if (M == 1 && !is_float_type(t) && local + WROWS <= rows[s]) {
                float res[WROWS];
                dot_weight_rows_typed(t, w[s] + local * rb, rb, k, a.q, a.d, a.s16, res);
                for (int i = 0; i < WROWS; i++) store_elem(y, r0 + i, res[i], y_bf16);
                continue;
            }
            for (int64_t r = r0; r < r0 + WROWS && r < total; r++, local++) {
                if (local == rows[s]) {
                    local = 0;
                    t = types[++s];
                    rb = gguf_row_bytes(t, k);
                }
                const uint8_t *row = w[s] + local * rb;
                if (is_float_type(t)) {
                    float_row(t, row, k, wf);
                    for (int64_t m = 0; m < M; m++) store_elem(y, m * ldy + r, dot_float(wf, xf + m * k, k), y_bf16);
                    continue;
                }
                for (int64_t m0 = 0; m0 < M; m0 += DOT_ROWS) {
                    int mr = M - m0 < DOT_ROWS ? (int)(M - m0) : DOT_ROWS;
                    float res[DOT_ROWS];
                    dot_rows(t, mr, row, k, a.q + m0 * k, a.d + m0 * (k / 32), a.s16 + m0 * (k / 16), res);
                    for (int m = 0; m < mr; m++) store_elem(y, (m0 + m) * ldy + r, res[m], y_bf16);
                }
            }
        }
        free(wf);
    }
    free(xf);
    free(a.q);
    free(a.d);
    free(a.s16);
    return 0;
}

/* Which vector path this build has: 2 AVX-512 VNNI, 1 AVX2, 0 portable C. */
int gguf_kernel_isa(void) {
#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* The native decode path's entry (common.h's MatvecFn): y = W x for one float32 row, W the
 * layer's shards as gguf_matmul takes them (the same product the layer's one-row step computes). */
typedef struct {
    int64_t nshards;
    const uint8_t *const *w;
    const int32_t *types;
    const int64_t *rows;
    int64_t k;
} GGUFMatvec;

EXPORT_SIZE(GGUFMatvec)

int gguf_matvec(const void *desc, const float *x, float *y) {
    const GGUFMatvec *d = desc;
    return gguf_matmul(d->nshards, d->w, d->types, d->rows, d->k, x, d->k, 0, 1, y, 0, 0);
}
