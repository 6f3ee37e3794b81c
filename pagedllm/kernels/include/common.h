/* What every native kernel (pagedllm/kernels/cpu/*.c) shares, written once: float16 and bfloat16 to
 * float and back (F16C where the build targets it), elements of either float type read and written
 * as floats, the horizontal sum of 8 floats, the matrix-vector entry type of the quantized kernels,
 * and the export of struct sizes that kernels/abi.py checks its ctypes mirrors against at load.
 */
#ifndef PAGEDLLM_KERNELS_COMMON_H
#define PAGEDLLM_KERNELS_COMMON_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

/* `int64_t T_size(void)`: sizeof(T), for the struct T that a Python caller fills (kernels/abi.py). */
#define EXPORT_SIZE(T) \
    int64_t T##_size(void) { return (int64_t)sizeof(T); }

/* A quantized layer's matrix-vector product as the native decode body calls it: y = W x for float x
 * [in] and y [out], W described by `desc` (its own kernel library knows the layout); 0 on success. */
typedef int (*MatvecFn)(const void *desc, const float *x, float *y);

INLINE float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* f rounded to bfloat16: to nearest even; NaN stays a (quiet) NaN. */
INLINE uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

INLINE float f16_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 113;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The float16 at p (a quantized block's scale): one instruction with F16C (every AVX2 CPU has it). */
INLINE float rd_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    return f16_to_float(h);
#endif
}

/* Element i of a float32 (bf16 == 0) or bfloat16 array, as a float. */
INLINE float load_elem(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* x stored as element i of a float32 (bf16 == 0) or bfloat16 array (rounded to nearest even). */
INLINE void store_elem(void *p, int64_t i, float x, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = float_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

/* 8 floats: one AVX2 register (GCC vector extensions: any target). */
typedef float float8 __attribute__((vector_size(32)));

/* The sum of v's 8 lanes as one fixed tree, the same on every target: the halves added, then lanes
 * 0 + 2 and 1 + 3 of that, then those two. Callers that must give one row the same result whatever
 * runs beside it (skinny_gemm.c) rely on the order. */
INLINE float hsum8(float8 v) {
#ifdef __AVX2__
    __m128 h = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#else
    typedef float float4 __attribute__((vector_size(16)));
    float4 a, b;
    memcpy(&a, &v, sizeof a);
    memcpy(&b, (const char *)&v + sizeof a, sizeof b);
    const float4 q = a + b;
    return (q[0] + q[2]) + (q[1] + q[3]);
#endif
}

#endif
