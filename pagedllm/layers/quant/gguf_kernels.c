/* GGUF (llama.cpp) block-quantized linear layers computed from the blocks as stored.
 *
 * A decode step is bound by reading the weights: the products here read each quantized block once
 * and never widen a weight to float in memory. As llama.cpp does, the activations are quantized to
 * int8 per 32-element block (one float scale each, plus the integer sums of each 16-element half,
 * which the types with minimums need), and each weight block is unpacked to int8 values with one
 * scale and one minimum per 16 elements, so every type is an integer dot product of 32 bytes:
 *
 *     sum_j w_j a_j = da * sum_{h in halves} (scale_h * sum_{j in h} q_j a_j  -  min_h * sum_{j in h} a_j)
 *
 * Paths: AVX2 (all of this file's vector code), whose u8 x s8 multiply-adds become one `vpdpbusd`
 * where the CPU has AVX-512 VNNI (compiled only then, by -march=native), and portable C that is only
 * slower. Q4_0, Q4_1 and Q8_0 (the common small-model types) have their own AVX2 unpacking; the
 * others unpack through the generic per-type C below, which the compiler vectorizes.
 * F32/F16/BF16 weights are multiplied in float (no activation quantization).
 *
 * Also: rows dequantized to float32 or bfloat16 (the batched path's tiles, the embedding's gather).
 * Built and loaded by gguf_native.py with the flags of the attention kernels (cpu_decode.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "quant_common.h"

/* ggml type ids (gguf GGMLQuantizationType). */
enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11,
       Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };

/* Elements and bytes of one block of each type (0: not a type of this file). */
static int64_t block_elems(int t) {
    switch (t) {
    case F32: case F16: case BF16: return 1;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
    case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: return 256;
    default: return 0;
    }
}
static int64_t block_bytes(int t) {
    switch (t) {
    case F32: return 4;
    case F16: case BF16: return 2;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}
INLINE int is_float_type(int t) { return t == F32 || t == F16 || t == BF16; }

/* Bytes of a row of k elements of type t; 0 where k is not whole blocks or t unknown. */
int64_t gguf_row_bytes(int t, int64_t k) {
    int64_t e = block_elems(t);
    return e && k % e == 0 ? k / e * block_bytes(t) : 0;
}

/* The K-quants' 6-bit scale and minimum of sub-block j (of 8) from their 12 packed bytes. */
INLINE void scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Unpack 32-element block b of a quantized row: value_j = sc[j/16] * q_j - mn[j/16]. */
static void unpack32(int t, const uint8_t *row, int64_t b, int8_t *q, float *sc, float *mn) {
    const uint8_t *p;
    switch (t) {
    case Q4_0: case Q4_1: {
        p = row + b * (t == Q4_0 ? 18 : 20);
        float d = rd_f16(p), m = t == Q4_1 ? rd_f16(p + 2) : 0.0f;
        const uint8_t *qs = p + (t == Q4_0 ? 2 : 4);
        int off = t == Q4_0 ? 8 : 0;
        for (int l = 0; l < 16; l++) {
            q[l] = (int8_t)((qs[l] & 0xF) - off);
            q[l + 16] = (int8_t)((qs[l] >> 4) - off);
        }
        sc[0] = sc[1] = d;
        mn[0] = mn[1] = -m;
        return;
    }
    case Q5_0: case Q5_1: {
        p = row + b * (t == Q5_0 ? 22 : 24);
        float d = rd_f16(p), m = t == Q5_1 ? rd_f16(p + 2) : 0.0f;
        const uint8_t *qhp = p + (t == Q5_0 ? 2 : 4), *qs = qhp + 4;
        uint32_t qh;
        memcpy(&qh, qhp, 4);
        int off = t == Q5_0 ? 16 : 0;
        for (int l = 0; l < 16; l++) {
            q[l] = (int8_t)(((qs[l] & 0xF) | (((qh >> l) & 1) << 4)) - off);
            q[l + 16] = (int8_t)(((qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - off);
        }
        sc[0] = sc[1] = d;
        mn[0] = mn[1] = -m;
        return;
    }
    case Q8_0: {
        p = row + b * 34;
        sc[0] = sc[1] = rd_f16(p);
        mn[0] = mn[1] = 0.0f;
        memcpy(q, p + 2, 32);
        return;
    }
    default: break;
    }
    /* K-quants: sub-block j of super-block s. */
    int64_t s = b / 8;
    int j = (int)(b % 8), n = j / 4, k = j % 4;
    switch (t) {
    case Q2_K: {
        p = row + s * 84;
        const uint8_t *scales = p, *qs = p + 16 + 32 * n;
        float d = rd_f16(p + 80), dmin = rd_f16(p + 82);
        for (int l = 0; l < 32; l++) q[l] = (int8_t)((qs[l] >> (2 * k)) & 3);
        for (int h = 0; h < 2; h++) {
            uint8_t v = scales[8 * n + 2 * k + h];
            sc[h] = d * (v & 0xF);
            mn[h] = dmin * (v >> 4);
        }
        return;
    }
    case Q3_K: {
        p = row + s * 110;
        const uint8_t *hmask = p, *qs = p + 32 + 32 * n, *packed = p + 96;
        float d = rd_f16(p + 108);
        uint8_t m = (uint8_t)(1u << (4 * n + k));
        for (int l = 0; l < 32; l++)
            q[l] = (int8_t)(((qs[l] >> (2 * k)) & 3) - ((hmask[l] & m) ? 0 : 4));
        for (int h = 0; h < 2; h++) {
            int i = 8 * n + 2 * k + h, v; /* 6-bit scale i: low 4 bits, then 2 high bits */
            int lo = i < 8 ? packed[i] & 0xF : packed[i - 8] >> 4;
            int hi = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
            v = (lo | (hi << 4)) - 32;
            sc[h] = d * v;
            mn[h] = 0.0f;
        }
        return;
    }
    case Q4_K: case Q5_K: {
        int q5 = t == Q5_K;
        p = row + s * (q5 ? 176 : 144);
        float d = rd_f16(p), dmin = rd_f16(p + 2);
        const uint8_t *scales = p + 4, *qh = p + 16, *qs = p + (q5 ? 48 : 16) + 32 * (j / 2);
        int shift = 4 * (j % 2), scv, mnv;
        for (int l = 0; l < 32; l++) {
            int v = (qs[l] >> shift) & 0xF;
            if (q5) v |= ((qh[l] >> j) & 1) << 4;
            q[l] = (int8_t)v;
        }
        scale_min_k4(j, scales, &scv, &mnv);
        sc[0] = sc[1] = d * scv;
        mn[0] = mn[1] = dmin * mnv;
        return;
    }
    case Q6_K: {
        p = row + s * 210;
        const uint8_t *ql = p + 64 * n + 32 * (k & 1), *qh = p + 128 + 32 * n;
        const int8_t *scales = (const int8_t *)(p + 192);
        float d = rd_f16(p + 208);
        int nib = 4 * (k >> 1);
        for (int l = 0; l < 32; l++)
            q[l] = (int8_t)((((ql[l] >> nib) & 0xF) | (((qh[l] >> (2 * k)) & 3) << 4)) - 32);
        for (int h = 0; h < 2; h++) {
            sc[h] = d * scales[8 * n + 2 * k + h];
            mn[h] = 0.0f;
        }
        return;
    }
    default: return;
    }
}

/* Row r of a float-typed weight as float32 (k elements). */
static void float_row(int t, const uint8_t *row, int64_t k, float *out) {
    if (t == F32) { memcpy(out, row, k * 4); return; }
    const uint16_t *h = (const uint16_t *)row;
    for (int64_t i = 0; i < k; i++) out[i] = t == F16 ? f16_to_float(h[i]) : bf16_to_float(h[i]);
}

#ifdef __AVX2__
/* The 32 nibbles of a Q4 block as unsigned bytes, in element order (low nibbles first). */
INLINE __m256i nibbles(const uint8_t *qs) {
    __m128i v = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(both, _mm256_set1_epi8(0xF));
}
/* out[0..32) = d * q + m for 32 signed bytes q. */
INLINE void store_block(__m256i q, float d, float m, float *out) {
    __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int h = 0; h < 2; h++) {
        __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(halves[h]));
        __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(halves[h], 8)));
        _mm256_storeu_ps(out + 16 * h, _mm256_fmadd_ps(lo, vd, vm));
        _mm256_storeu_ps(out + 16 * h + 8, _mm256_fmadd_ps(hi, vd, vm));
    }
}
#endif

/* A row of k elements dequantized to float32. */
static void dequant_row(int t, const uint8_t *row, int64_t k, float *out) {
    if (is_float_type(t)) { float_row(t, row, k, out); return; }
#ifdef __AVX2__
    if (t == Q4_0 || t == Q4_1 || t == Q8_0) {
        int64_t bb = block_bytes(t);
        for (int64_t b = 0; b < k / 32; b++) {
            const uint8_t *p = row + b * bb;
            float d = rd_f16(p);
            if (t == Q8_0) store_block(_mm256_loadu_si256((const __m256i *)(p + 2)), d, 0.0f, out + 32 * b);
            else if (t == Q4_1) store_block(nibbles(p + 4), d, rd_f16(p + 2), out + 32 * b);
            else store_block(nibbles(p + 2), d, -8.0f * d, out + 32 * b);
        }
        return;
    }
#endif
    int8_t q[32];
    float sc[2], mn[2];
    for (int64_t b = 0; b < k / 32; b++) {
        unpack32(t, row, b, q, sc, mn);
        for (int l = 0; l < 32; l++) out[32 * b + l] = sc[l / 16] * q[l] - mn[l / 16];
    }
}

INLINE void store_out(void *out, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)out)[i] = float_to_bf16(v);
    else ((float *)out)[i] = v;
}

/* Rows ids[0..n) (or 0..n when ids is NULL) of a [nrows, k] weight of type t, dequantized to out
 * [n, k] (bfloat16 when out_bf16). Returns -1 for an unknown type or a k that is not whole blocks,
 * -2 for an id outside [0, nrows). */
int gguf_dequantize_rows(int t, const uint8_t *w, int64_t nrows, int64_t k, const int64_t *ids, int64_t n,
                         void *out, int out_bf16) {
    int64_t rb = gguf_row_bytes(t, k);
    if (!rb) return -1;
    for (int64_t i = 0; ids && i < n; i++)
        if (ids[i] < 0 || ids[i] >= nrows) return -2;
#pragma omp parallel
    {
        float *tmp = malloc(k * sizeof(float));
#pragma omp for schedule(static)
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
    }
    return 0;
}

/* Activations quantized per 32-element block: int8 values, the block's scale and the integer sum of
 * each 16-element half. */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *s16;
    float *sum; /* d times the block's sum */
} QAct;

static void quantize_row(const float *x, int64_t k, int8_t *q, float *d, int32_t *s16) {
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(xb[l]));
        float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        int32_t s0 = 0, s1 = 0;
        for (int l = 0; l < 32; l++) {
            int v = (int)lrintf(xb[l] * inv);
            q[32 * b + l] = (int8_t)v;
            if (l < 16) s0 += v; else s1 += v;
        }
        d[b] = scale;
        s16[2 * b] = s0;
        s16[2 * b + 1] = s1;
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

/* sum_j w_j x_j over a quantized row (k elements) against one quantized activation row (`asum`: each
 * block's scale times the sum of its values, for the types with a minimum or an offset). */
static float dot_row(int t, const uint8_t *row, int64_t k, const int8_t *aq, const float *ad,
                     const int32_t *as, const float *asum) {
    int64_t nb = k / 32;
#ifdef __AVX2__
    if (t == Q4_0 || t == Q4_1 || t == Q8_0) {
        /* Two accumulators: consecutive blocks' multiply-adds do not wait on each other. */
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        float offset = 0.0f;
        int64_t bb = block_bytes(t), qs_at = t == Q4_1 ? 4 : 2;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *p = row + b * bb;
            __m256i a = _mm256_loadu_si256((const __m256i *)(aq + 32 * b));
            __m256i sums;
            float d = rd_f16(p);
            if (t == Q8_0) { /* signed x signed: |w| times a with w's sign */
                __m256i w = _mm256_loadu_si256((const __m256i *)(p + 2));
                sums = dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
            } else {
                sums = dot_u8s8(nibbles(p + qs_at), a);
                /* Q4_0: w = d (n - 8); Q4_1: w = d n + m. */
                offset += asum[b] * (t == Q4_0 ? -8.0f * d : rd_f16(p + 2));
            }
            __m256 prod = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d * ad[b]));
            if (b & 1) acc1 = _mm256_add_ps(acc1, prod);
            else acc0 = _mm256_add_ps(acc0, prod);
        }
        return hsum8(_mm256_add_ps(acc0, acc1)) + offset;
    }
#endif
    int8_t q[32];
    float sc[2], mn[2], total = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        unpack32(t, row, b, q, sc, mn);
        const int8_t *a = aq + 32 * b;
        int32_t s0 = 0, s1 = 0;
        for (int l = 0; l < 16; l++) s0 += q[l] * a[l];
        for (int l = 16; l < 32; l++) s1 += q[l] * a[l];
        total += ad[b] * (sc[0] * s0 + sc[1] * s1 - mn[0] * as[2 * b] - mn[1] * as[2 * b + 1]);
    }
    (void)asum;
    return total;
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
            xf[m * k + i] = x_bf16 ? bf16_to_float(((const uint16_t *)x)[m * ldx + i])
                                   : ((const float *)x)[m * ldx + i];
    QAct a = {0};
    if (any_quant) {
        a.q = malloc(M * k);
        a.d = malloc(M * (k / 32) * sizeof(float));
        a.s16 = malloc(M * (k / 16) * sizeof(int32_t));
        a.sum = malloc(M * (k / 32) * sizeof(float));
        for (int64_t m = 0; m < M; m++)
            quantize_row(xf + m * k, k, a.q + m * k, a.d + m * (k / 32), a.s16 + m * (k / 16));
        for (int64_t b = 0; b < M * (k / 32); b++) a.sum[b] = a.d[b] * (a.s16[2 * b] + a.s16[2 * b + 1]);
    }
#pragma omp parallel
    {
        float *wf = any_float ? malloc(k * sizeof(float)) : NULL;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < total; r++) {
            int64_t s = 0, local = r;
            while (local >= rows[s]) local -= rows[s++];
            int t = types[s];
            const uint8_t *row = w[s] + local * gguf_row_bytes(t, k);
            if (is_float_type(t)) float_row(t, row, k, wf);
            for (int64_t m = 0; m < M; m++) {
                float v = is_float_type(t)
                              ? dot_float(wf, xf + m * k, k)
                              : dot_row(t, row, k, a.q + m * k, a.d + m * (k / 32), a.s16 + m * (k / 16),
                                        a.sum + m * (k / 32));
                store_out(y, m * ldy + r, v, y_bf16);
            }
        }
        free(wf);
    }
    free(xf);
    free(a.q);
    free(a.d);
    free(a.s16);
    free(a.sum);
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

/* The native decode path's entry (llama_decode.c's MatvecFn): y = W x for one float32 row, W the
 * layer's shards as gguf_matmul takes them (the same product the layer's one-row step computes). */
typedef struct {
    int64_t nshards;
    const uint8_t *const *w;
    const int32_t *types;
    const int64_t *rows;
    int64_t k;
} GGUFMatvec;

int gguf_matvec(const void *desc, const float *x, float *y) {
    const GGUFMatvec *d = desc;
    return gguf_matmul(d->nshards, d->w, d->types, d->rows, d->k, x, d->k, 0, 1, y, 0, 0);
}
