/* Float vectors for the attention kernels and the native decode body (cpu/attention_*.c,
 * cpu/llama_decode.c), as wide as
 * the CPU's vector registers: 16 floats (one zmm) where the build targets AVX-512, else 8 (one ymm
 * on AVX2). A vector wider than the registers is split by the compiler into register-sized halves
 * moved through memory: with 16-float vectors on an AVX2 CPU half the decode kernel's instructions
 * were stack loads and stores, and its time grew with every query row added.
 *
 * The code is GCC vector extensions throughout, correct on any target the compiler knows (it
 * lowers them to what the target has); the few operations that the generic form compiles badly
 * (widening loads of bfloat16 and fp8, horizontal sums and maxima, the transpose-sum) have AVX2 and
 * AVX-512 intrinsic versions, chosen by the compiler's own target macros (a build without
 * -march=native, or for another architecture, takes the generic ones).
 */
#ifndef PAGEDLLM_KERNELS_VEC_H
#define PAGEDLLM_KERNELS_VEC_H

#include <float.h>
#include <math.h>

#include "common.h"

#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define VEC_AVX2 1
#endif

typedef float vec __attribute__((vector_size(LANES * 4)));
typedef int32_t int_vec __attribute__((vector_size(LANES * 4)));
typedef uint32_t word_vec __attribute__((vector_size(LANES * 4)));
typedef uint16_t bf16_vec __attribute__((vector_size(LANES * 2)));
typedef uint8_t byte_vec __attribute__((vector_size(LANES)));

/* Element types: of the activations (F32 or BF16) and of the cache (any). */
enum { F32 = 0, BF16 = 1, E4M3 = 2, E5M2 = 3 };
#define ELEM_SIZE(type) ((type) == F32 ? 4 : (type) == BF16 ? 2 : 1)

/* fp8 formats as (mantissa bits, exponent bias, largest finite value). An fp8 magnitude's bits
 * shifted to a float's top bits (below the sign) are that float's exponent and mantissa with the
 * float's bias (127): multiplying by 2^(bias - 127) corrects it, subnormals included (they land on
 * float subnormals). Shifted to a float16's top bits they are a float16 with bias 15: e5m2 is the
 * top byte of a float16, exactly. */
#define FP8_MANT(type) ((type) == E4M3 ? 3 : 2)
#define FP8_BIAS(type) ((type) == E4M3 ? 7 : 15)
#define FP8_MAX(type) ((type) == E4M3 ? 448.0f : 57344.0f)
/* The loads below widen an fp8 element x to x * 2^(bias - 15), its bits read as a float16's (one
 * hardware conversion where the CPU has F16C, no scaling): a kernel multiplies by this factor once,
 * folded into its scales. */
#define FP8_LOAD_SCALE(type) ((type) == E4M3 ? 256.0f : 1.0f)

INLINE float pow2(int e) {
    const uint32_t bits = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* LANES floats at p (any alignment), and stored there. */
INLINE vec load_floats(const float *p) {
    vec f;
    memcpy(&f, p, sizeof f);
    return f;
}

INLINE void store_floats(float *p, vec x) { memcpy(p, &x, sizeof x); }

/* LANES elements at `p` of `type` as floats (fp8 ones unscaled). */
INLINE vec load_vec(const char *p, int type) {
    if (type == F32) return load_floats((const float *)p);
    vec f;
    if (type == E4M3 || type == E5M2) {
#if defined(VEC_AVX2)
        const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#elif defined(__AVX512F__)
        const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
        byte_vec b;
        memcpy(&b, p, sizeof b);
        const word_vec w = __builtin_convertvector(b, word_vec);
#endif
        word_vec u;
        memcpy(&u, &w, sizeof u);
        const word_vec bits = ((u & 0x7fu) << (23 - FP8_MANT(type))) | ((u & 0x80u) << 24);
        memcpy(&f, &bits, sizeof f);
        return f * pow2(127 - 15);
    }
    /* bfloat16: one widening load (the generic conversion compiles to two half-width ones and an
     * insert). */
#if defined(VEC_AVX2)
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#elif defined(__AVX512F__)
    const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    bf16_vec h;
    memcpy(&h, p, sizeof h);
    const word_vec w = __builtin_convertvector(h, word_vec) << 16;
#endif
    memcpy(&f, &w, sizeof f);
    return f;
}

/* a * b + c, fused where the target has FMA. The intrinsic also keeps the compiler from
 * reassociating a chain of them (under -fassociative-math it split a dot product's chains into
 * trees whose partial sums no longer fit the registers). */
INLINE vec fma_vec(vec a, vec b, vec c) {
#if defined(VEC_AVX2)
    return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__AVX512F__)
    return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    return a * b + c;
#endif
}

#if defined(VEC_AVX2) && defined(__F16C__)
/* 16 fp8 elements at p as two vectors of 8 floats (scaled as load_vec's): each byte becomes the top
 * byte of a float16 (e4m3's magnitude then shifted down one bit below its sign), and F16C widens
 * those. Half the shifts of the float bit trick, which bound this conversion on the shift unit. */
INLINE void load_fp8_16(const char *p, int type, vec *lo, vec *hi) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), zero = _mm_setzero_si128();
    __m128i h0 = _mm_unpacklo_epi8(zero, b), h1 = _mm_unpackhi_epi8(zero, b);
    if (type == E4M3) {
        const __m128i keep = _mm_set1_epi16((short)0xbfff); /* the sign's copy that the shift made */
        h0 = _mm_and_si128(_mm_srai_epi16(h0, 1), keep);
        h1 = _mm_and_si128(_mm_srai_epi16(h1, 1), keep);
    }
    *lo = (vec)_mm256_cvtph_ps(h0);
    *hi = (vec)_mm256_cvtph_ps(h1);
}
#endif

/* n elements (a multiple of LANES) at p of `type` widened to floats at dst (fp8 as load_vec). */
INLINE void widen_row(const char *p, float *dst, int64_t n, int type) {
    int64_t i = 0;
#if defined(VEC_AVX2) && defined(__F16C__)
    if (type == E4M3 || type == E5M2)
        for (; i + 16 <= n; i += 16) {
            vec lo, hi;
            load_fp8_16(p + i, type, &lo, &hi);
            store_floats(dst + i, lo);
            store_floats(dst + i + 8, hi);
        }
#endif
    for (; i < n; i += LANES) store_floats(dst + i, load_vec(p + i * ELEM_SIZE(type), type));
}

/* x rounded to bfloat16 (to nearest even; NaN stays NaN), as float_to_bf16 per lane. */
INLINE bf16_vec vec_to_bf16(vec x) {
    word_vec u;
    memcpy(&u, &x, sizeof u);
    const word_vec rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const word_vec is_nan = (word_vec)((u & 0x7fffffffu) > 0x7f800000u);
    const word_vec bits = (((u >> 16) | 0x40u) & is_nan) | (rounded & ~is_nan);
    return __builtin_convertvector(bits, bf16_vec);
}

/* Stores x to LANES elements at `p`: floats, or (bf16) bfloat16. */
INLINE void store_vec(char *p, vec x, int bf16) {
    if (bf16) {
        const bf16_vec h = vec_to_bf16(x);
        memcpy(p, &h, sizeof h);
    } else {
        memcpy(p, &x, sizeof x);
    }
}

INLINE float hsum(vec x) {
#if defined(VEC_AVX2)
    return hsum8(x);
#elif defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)x);
#else
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += x[i];
    return s;
#endif
}

INLINE float hmax(vec x) {
#if defined(VEC_AVX2)
    const __m256 v = (__m256)x;
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#elif defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)x);
#else
    float m = x[0];
    for (int i = 1; i < LANES; i++) m = x[i] > m ? x[i] : m;
    return m;
#endif
}

/* Lanes of `a` where `mask` is set, of `b` elsewhere. */
INLINE vec select_vec(int_vec mask, vec a, vec b) {
    return (vec)(((int_vec)a & mask) | ((int_vec)b & ~mask));
}

/* a + b, or with `max` the larger of each lane. */
INLINE vec combine(vec a, vec b, const int max) {
    return max ? select_vec(a > b, a, b) : a + b;
}

/* Lane i of the result: the sum (with `max`, the largest) of v[i]'s lanes, for LANES vectors v. A
 * transpose tree (each level combines the two halves of pairs of vectors, interleaved so the last
 * level leaves the results in order) costs LANES - 1 two-shuffle steps for LANES results instead of
 * LANES horizontal reductions. */
#if LANES == 16
INLINE vec reduce_lanes(const vec *v, const int max) {
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
#else
INLINE vec reduce_lanes(const vec *v, const int max) {
#if defined(VEC_AVX2)
    if (!max) {
        /* Pairwise sums within 128-bit halves, then the halves' partial sums added across. */
        const __m256 a = _mm256_hadd_ps((__m256)v[0], (__m256)v[1]), b = _mm256_hadd_ps((__m256)v[2], (__m256)v[3]);
        const __m256 c = _mm256_hadd_ps((__m256)v[4], (__m256)v[5]), d = _mm256_hadd_ps((__m256)v[6], (__m256)v[7]);
        const __m256 lo = _mm256_hadd_ps(a, b), hi = _mm256_hadd_ps(c, d);
        return (vec)_mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
    }
#endif
    vec r1[4], r2[2];
    for (int i = 0; i < 4; i++)
        r1[i] = combine(__builtin_shuffle(v[i], v[i + 4], (int_vec){0, 1, 2, 3, 8, 9, 10, 11}),
                        __builtin_shuffle(v[i], v[i + 4], (int_vec){4, 5, 6, 7, 12, 13, 14, 15}), max);
    for (int i = 0; i < 2; i++)
        r2[i] = combine(__builtin_shuffle(r1[i], r1[i + 2], (int_vec){0, 1, 8, 9, 4, 5, 12, 13}),
                        __builtin_shuffle(r1[i], r1[i + 2], (int_vec){2, 3, 10, 11, 6, 7, 14, 15}), max);
    return combine(__builtin_shuffle(r2[0], r2[1], (int_vec){0, 8, 2, 10, 4, 12, 6, 14}),
                   __builtin_shuffle(r2[0], r2[1], (int_vec){1, 9, 3, 11, 5, 13, 7, 15}), max);
}
#endif

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
    return p * pow2(n);
}

/* exp_nonpositive on every lane (the same steps in vector operations). */
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

/* Gemma-2's logit soft cap, cap * tanh(s / cap), on every lane. tanh(|y|) = (1 - t) / (1 + t) with
 * t = e^(-2|y|) <= 1, so exp_nonpositive_vec serves; the absolute error stays ~cap * 1e-7. */
INLINE vec soft_cap_vec(vec s, float cap) {
    const vec y = s * (1.0f / cap);
    const vec t = exp_nonpositive_vec(select_vec(y < 0.0f, y, -y) * 2.0f);
    const vec th = (1.0f - t) / (1.0f + t);
    return select_vec(y < 0.0f, -th, th) * cap;
}

#endif
