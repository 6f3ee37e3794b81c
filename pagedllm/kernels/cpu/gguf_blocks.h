/* The GGUF block layouts (included by gguf_kernels.c and gguf_panels.c): each type's block sizes, and
 * 32-element block b of a quantized row as 32 bytes q (unsigned for every type but Q8_0) with one scale
 * and one minimum per 16-element half, value_j = sc[j/16] * q_j - mn[j/16]: the scales by
 * `block_scales`, the bytes by `unpack_q` (portable C) or `unpack_q8x32` (AVX2, every type); and whole
 * rows or ranges of a row dequantized to float32 (`dequant_row`, `dequant_range`). */
#ifndef PAGEDLLM_GGUF_BLOCKS_H
#define PAGEDLLM_GGUF_BLOCKS_H
#include <stdint.h>
#include <string.h>
#include "common.h"

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

/* The quantized types, each a case calling BODY(type) with the type a constant, so that the inlined
 * per-block code is specialized for it. */
#define for_each_type(t, BODY)                                                                        \
    switch (t) {                                                                                      \
    case Q4_0: BODY(Q4_0); case Q4_1: BODY(Q4_1); case Q5_0: BODY(Q5_0); case Q5_1: BODY(Q5_1);       \
    case Q8_0: BODY(Q8_0); case Q2_K: BODY(Q2_K); case Q3_K: BODY(Q3_K); case Q4_K: BODY(Q4_K);       \
    case Q5_K: BODY(Q5_K); case Q6_K: BODY(Q6_K); default: break;                                     \
    }

/* Bytes of a row of k elements of type t; 0 where k is not whole blocks or t unknown (gguf_kernels.c). */
int64_t gguf_row_bytes(int t, int64_t k);

/* Row r of a float-typed weight as float32 (k elements). */
INLINE void float_row(int t, const uint8_t *row, int64_t k, float *out) {
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

/* Blocks b0..b1 (32 elements each) of a quantized row of type t dequantized to float32 at out. */
INLINE void dequant_blocks(int t, const uint8_t *row, int64_t b0, int64_t b1, float *out) {
    for (int64_t b = b0; b < b1; b++, out += 32) {
        float sc[2], mn[2];
        block_scales(t, row, b, sc, mn);
#ifdef __AVX2__
        __m256i q = unpack_q8x32(t, row, b);
        __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
        for (int h = 0; h < 2; h++) {
            __m256 vs = _mm256_set1_ps(sc[h]), vm = _mm256_set1_ps(mn[h]);
            __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(halves[h]));
            __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(halves[h], 8)));
            _mm256_storeu_ps(out + 16 * h, _mm256_fmsub_ps(lo, vs, vm));
            _mm256_storeu_ps(out + 16 * h + 8, _mm256_fmsub_ps(hi, vs, vm));
        }
#else
        int8_t q[32];
        unpack_q(t, row, b, q);
        for (int l = 0; l < 32; l++) out[l] = sc[l / 16] * q[l] - mn[l / 16];
#endif
    }
}

/* Elements e0..e1 (multiples of 32) of a row of type t dequantized to float32 at out. */
INLINE void dequant_range(int t, const uint8_t *row, int64_t e0, int64_t e1, float *out) {
    if (is_float_type(t)) { float_row(t, row + e0 * block_bytes(t), e1 - e0, out); return; }
#define DEQUANT(T) dequant_blocks(T, row, e0 / 32, e1 / 32, out); return;
    for_each_type(t, DEQUANT)
#undef DEQUANT
}

/* A row of k elements dequantized to float32. */
INLINE void dequant_row(int t, const uint8_t *row, int64_t k, float *out) { dequant_range(t, row, 0, k, out); }

#endif
