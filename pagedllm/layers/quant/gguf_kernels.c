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
 * Every block is unpacked as unsigned bytes (Q8_0: signed) with one scale and one minimum per half:
 * the bytes by `unpack_q` (portable C) or `unpack_q8x32` (AVX2, every type), the scales by
 * `block_scales` (shared). Paths: AVX2, whose u8 x s8 multiply-adds become one `vpdpbusd` where the
 * CPU has AVX-512 VNNI (compiled only then, by -march=native), and portable C that is only slower
 * (tests build it without -march=native and compare). The per-block loops are specialized per type
 * (`for_each_type`), so the type switches fold away inside them.
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

/* The scale and minimum of each 16-element half of 32-element block b of a quantized row, for the
 * bytes q that `unpack_q` gives: value_j = sc[j/16] * q_j - mn[j/16]. The offsets of the symmetric
 * types (Q4_0's 8, Q3_K's 4, ...) are minimums, so that q is unsigned for every type but Q8_0. */
INLINE void block_scales(int t, const uint8_t *row, int64_t b, float *sc, float *mn) {
    int64_t s = b / 8; /* K-quants: sub-block j of super-block s */
    int j = (int)(b % 8), n = j / 4, k = j % 4;
    const uint8_t *p;
    switch (t) {
    case Q4_0: case Q5_0: case Q8_0: {
        float d = rd_f16(row + b * block_bytes(t));
        sc[0] = sc[1] = d;
        mn[0] = mn[1] = t == Q4_0 ? 8.0f * d : t == Q5_0 ? 16.0f * d : 0.0f;
        return;
    }
    case Q4_1: case Q5_1:
        p = row + b * block_bytes(t);
        sc[0] = sc[1] = rd_f16(p);
        mn[0] = mn[1] = -rd_f16(p + 2);
        return;
    case Q2_K: {
        p = row + s * 84;
        float d = rd_f16(p + 80), dmin = rd_f16(p + 82);
        for (int h = 0; h < 2; h++) {
            uint8_t v = p[8 * n + 2 * k + h];
            sc[h] = d * (v & 0xF);
            mn[h] = dmin * (v >> 4);
        }
        return;
    }
    case Q3_K: {
        p = row + s * 110;
        const uint8_t *packed = p + 96;
        float d = rd_f16(p + 108);
        for (int h = 0; h < 2; h++) {
            int i = 8 * n + 2 * k + h; /* 6-bit scale i: low 4 bits, then 2 high bits */
            int lo = i < 8 ? packed[i] & 0xF : packed[i - 8] >> 4;
            int hi = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
            sc[h] = d * ((lo | (hi << 4)) - 32);
            mn[h] = 4.0f * sc[h];
        }
        return;
    }
    case Q4_K: case Q5_K: {
        p = row + s * block_bytes(t);
        int scv, mnv;
        scale_min_k4(j, p + 4, &scv, &mnv);
        sc[0] = sc[1] = rd_f16(p) * scv;
        mn[0] = mn[1] = rd_f16(p + 2) * mnv;
        return;
    }
    case Q6_K: {
        p = row + s * 210;
        float d = rd_f16(p + 208);
        for (int h = 0; h < 2; h++) {
            sc[h] = d * (int8_t)p[192 + 8 * n + 2 * k + h];
            mn[h] = 32.0f * sc[h];
        }
        return;
    }
    default: return;
    }
}

/* The 32 quantized values of block b of a row (see block_scales), in element order. */
INLINE void unpack_q(int t, const uint8_t *row, int64_t b, int8_t *q) {
    int64_t s = b / 8;
    int j = (int)(b % 8), n = j / 4, k = j % 4;
    const uint8_t *p = row + (block_elems(t) == 32 ? b : s) * block_bytes(t);
    switch (t) {
    case Q4_0: case Q4_1: {
        const uint8_t *qs = p + (t == Q4_0 ? 2 : 4);
        for (int l = 0; l < 16; l++) {
            q[l] = (int8_t)(qs[l] & 0xF);
            q[l + 16] = (int8_t)(qs[l] >> 4);
        }
        return;
    }
    case Q5_0: case Q5_1: {
        const uint8_t *qhp = p + (t == Q5_0 ? 2 : 4), *qs = qhp + 4;
        uint32_t qh;
        memcpy(&qh, qhp, 4);
        for (int l = 0; l < 16; l++) {
            q[l] = (int8_t)((qs[l] & 0xF) | (((qh >> l) & 1) << 4));
            q[l + 16] = (int8_t)((qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4));
        }
        return;
    }
    case Q8_0: memcpy(q, p + 2, 32); return;
    case Q2_K:
        for (int l = 0; l < 32; l++) q[l] = (int8_t)((p[16 + 32 * n + l] >> (2 * k)) & 3);
        return;
    case Q3_K: {
        uint8_t m = (uint8_t)(1u << (4 * n + k));
        for (int l = 0; l < 32; l++)
            q[l] = (int8_t)(((p[32 + 32 * n + l] >> (2 * k)) & 3) | ((p[l] & m) ? 4 : 0));
        return;
    }
    case Q4_K: case Q5_K: {
        int q5 = t == Q5_K, shift = 4 * (j % 2);
        const uint8_t *qs = p + (q5 ? 48 : 16) + 32 * (j / 2), *qh = p + 16;
        for (int l = 0; l < 32; l++) q[l] = (int8_t)(((qs[l] >> shift) & 0xF) | (q5 ? ((qh[l] >> j) & 1) << 4 : 0));
        return;
    }
    case Q6_K: {
        const uint8_t *ql = p + 64 * n + 32 * (k & 1), *qh = p + 128 + 32 * n;
        int nib = 4 * (k >> 1);
        for (int l = 0; l < 32; l++) q[l] = (int8_t)(((ql[l] >> nib) & 0xF) | (((qh[l] >> (2 * k)) & 3) << 4));
        return;
    }
    default: return;
    }
}

#ifdef __AVX2__
/* The 32 nibbles of a Q4 block as unsigned bytes, in element order (low nibbles first). */
INLINE __m256i nibbles(const uint8_t *qs) {
    __m128i v = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(both, _mm256_set1_epi8(0xF));
}
/* Byte l of the result: 0xFF where bit l of the 32 bits at p is set, else 0. */
INLINE __m256i bit_bytes(const uint8_t *p) {
    uint32_t x;
    memcpy(&x, p, 4);
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), spread);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    return _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
}
/* Bytes of v shifted right by `by` bits and masked: their own bits only (16-bit lanes leak the
 * neighbour's bits into the top, which the mask clears). */
INLINE __m256i field(__m256i v, int by, int mask) {
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(by)), _mm256_set1_epi8((char)mask));
}
/* Where bit `m` of each byte of v is set: `value`, else 0. */
INLINE __m256i flag(__m256i v, int m, int value) {
    __m256i mv = _mm256_set1_epi8((char)m);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, mv), mv), _mm256_set1_epi8((char)value));
}
#define LOAD32(p) _mm256_loadu_si256((const __m256i *)(p))

/* unpack_q in one register. */
INLINE __m256i unpack_q8x32(int t, const uint8_t *row, int64_t b) {
    int64_t s = b / 8;
    int j = (int)(b % 8), n = j / 4, k = j % 4;
    const uint8_t *p = row + (block_elems(t) == 32 ? b : s) * block_bytes(t);
    switch (t) {
    case Q4_0: return nibbles(p + 2);
    case Q4_1: return nibbles(p + 4);
    case Q5_0: case Q5_1: {
        const uint8_t *qh = p + (t == Q5_0 ? 2 : 4);
        return _mm256_or_si256(nibbles(qh + 4), _mm256_and_si256(bit_bytes(qh), _mm256_set1_epi8(0x10)));
    }
    case Q8_0: return LOAD32(p + 2);
    case Q2_K: return field(LOAD32(p + 16 + 32 * n), 2 * k, 3);
    case Q3_K: return _mm256_or_si256(field(LOAD32(p + 32 + 32 * n), 2 * k, 3), flag(LOAD32(p), 1 << (4 * n + k), 4));
    case Q4_K: return field(LOAD32(p + 16 + 32 * (j / 2)), 4 * (j % 2), 0xF);
    case Q5_K:
        return _mm256_or_si256(field(LOAD32(p + 48 + 32 * (j / 2)), 4 * (j % 2), 0xF), flag(LOAD32(p + 16), 1 << j, 0x10));
    case Q6_K: {
        __m256i lo = field(LOAD32(p + 64 * n + 32 * (k & 1)), 4 * (k >> 1), 0xF);
        return _mm256_or_si256(lo, _mm256_slli_epi16(field(LOAD32(p + 128 + 32 * n), 2 * k, 3), 4));
    }
    default: return _mm256_setzero_si256();
    }
}
#endif

/* Row r of a float-typed weight as float32 (k elements). */
static void float_row(int t, const uint8_t *row, int64_t k, float *out) {
    if (t == F32) { memcpy(out, row, k * 4); return; }
    const uint16_t *h = (const uint16_t *)row;
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= k; i += 8) {
        __m128i v = _mm_loadu_si128((const __m128i *)(h + i));
        __m256 f = t == F16 ? _mm256_cvtph_ps(v) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
        _mm256_storeu_ps(out + i, f);
    }
#endif
    for (; i < k; i++) out[i] = t == F16 ? f16_to_float(h[i]) : bf16_to_float(h[i]);
}

/* The quantized types, each a case calling BODY(type) with the type a constant, so that the inlined
 * per-block code is specialized for it. */
#define for_each_type(t, BODY)                                                                        \
    switch (t) {                                                                                      \
    case Q4_0: BODY(Q4_0); case Q4_1: BODY(Q4_1); case Q5_0: BODY(Q5_0); case Q5_1: BODY(Q5_1);       \
    case Q8_0: BODY(Q8_0); case Q2_K: BODY(Q2_K); case Q3_K: BODY(Q3_K); case Q4_K: BODY(Q4_K);       \
    case Q5_K: BODY(Q5_K); case Q6_K: BODY(Q6_K); default: break;                                     \
    }

INLINE void dequant_blocks(int t, const uint8_t *row, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 32; b++) {
        float sc[2], mn[2];
        block_scales(t, row, b, sc, mn);
#ifdef __AVX2__
        __m256i q = unpack_q8x32(t, row, b);
        __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
        for (int h = 0; h < 2; h++) {
            __m256 vs = _mm256_set1_ps(sc[h]), vm = _mm256_set1_ps(mn[h]);
            __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(halves[h]));
            __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(halves[h], 8)));
            _mm256_storeu_ps(out + 32 * b + 16 * h, _mm256_fmsub_ps(lo, vs, vm));
            _mm256_storeu_ps(out + 32 * b + 16 * h + 8, _mm256_fmsub_ps(hi, vs, vm));
        }
#else
        int8_t q[32];
        unpack_q(t, row, b, q);
        for (int l = 0; l < 32; l++) out[32 * b + l] = sc[l / 16] * q[l] - mn[l / 16];
#endif
    }
}

/* A row of k elements dequantized to float32. */
static void dequant_row(int t, const uint8_t *row, int64_t k, float *out) {
    if (is_float_type(t)) { float_row(t, row, k, out); return; }
#define DEQUANT(T) dequant_blocks(T, row, k, out); return;
    for_each_type(t, DEQUANT)
#undef DEQUANT
}

INLINE void store_out(void *out, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)out)[i] = float_to_bf16(v);
    else ((float *)out)[i] = v;
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

/* Activations quantized per 32-element block: int8 values, the block's scale and the integer sum of
 * each 16-element half (for the minimums). */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *s16;
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

/* Activation rows dotted with each weight row in one pass: each block is unpacked once for all. */
#define DOT_ROWS 4

/* sum_j w_j x_j of a quantized row (k elements) with each of `mr` (<= DOT_ROWS) quantized activation
 * rows (consecutive in aq, ad, as) into res[0..mr): per block,
 * da * (sum_h sc_h * sum_{j in h} q_j a_j  -  sum_h mn_h * sum_{j in h} a_j). */
INLINE void dot_blocks(int t, int mr, const uint8_t *row, int64_t k, const int8_t *aq, const float *ad,
                       const int32_t *as, float *res) {
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
            minimums[m] += da * (mn[0] * as[m * 2 * nb + 2 * b] + mn[1] * as[m * 2 * nb + 2 * b + 1]);
#ifdef __AVX2__
            __m256i a = LOAD32(aq + m * k + 32 * b);
            /* Q8_0 is signed x signed: |w| times a with w's sign. */
            __m256i sums = dot_u8s8(uq, t == Q8_0 ? _mm256_sign_epi8(a, q) : a);
            /* Lanes 0-3 sum the first half's products, lanes 4-7 the second's. */
            __m256 scale = _mm256_set_m128(_mm_set1_ps(sc[1] * da), _mm_set1_ps(sc[0] * da));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[m]);
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

/* dot_blocks specialized for each type and row count. */
static void dot_rows(int t, int mr, const uint8_t *row, int64_t k, const int8_t *aq, const float *ad,
                     const int32_t *as, float *res) {
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
            xf[m * k + i] = x_bf16 ? bf16_to_float(((const uint16_t *)x)[m * ldx + i])
                                   : ((const float *)x)[m * ldx + i];
    QAct a = {0};
    if (any_quant) {
        a.q = malloc(M * k);
        a.d = malloc(M * (k / 32) * sizeof(float));
        a.s16 = malloc(M * (k / 16) * sizeof(int32_t));
        for (int64_t m = 0; m < M; m++)
            quantize_row(xf + m * k, k, a.q + m * k, a.d + m * (k / 32), a.s16 + m * (k / 16));
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
            if (is_float_type(t)) {
                float_row(t, row, k, wf);
                for (int64_t m = 0; m < M; m++) store_out(y, m * ldy + r, dot_float(wf, xf + m * k, k), y_bf16);
                continue;
            }
            for (int64_t m0 = 0; m0 < M; m0 += DOT_ROWS) {
                int mr = M - m0 < DOT_ROWS ? (int)(M - m0) : DOT_ROWS;
                float res[DOT_ROWS];
                dot_rows(t, mr, row, k, a.q + m0 * k, a.d + m0 * (k / 32), a.s16 + m0 * (k / 16), res);
                for (int m = 0; m < mr; m++) store_out(y, (m0 + m) * ldy + r, res[m], y_bf16);
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
