/* Rows of an fp8 weight widened to float32 for the batched product (fp8.py): out[r][i] =
 * table[q[r][i]] * scale[r], where `table` holds the float value of each of the 256 fp8 bit patterns
 * (computed by torch, so this file knows no fp8 format). torch's own fp8 -> float32 copy on the CPU
 * converts element by element through a slow generic path (~10 ns an element measured, against ~1 ns
 * here). Also the native decode path's one-row product (`fp8_matvec`). Built by kernels/build.py
 * into the fp8 kernel library; bindings: layers/quant/fp8.py. */
#include <stdint.h>
#include "common.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FP8_AVX2 1
#endif

/* One thread: a tile of the batched product (tiles.py) is cheaper than waking a second one on a busy
 * machine. */
void fp8_widen_rows(const uint8_t *q, const float *scale, const float *table, int64_t n, int64_t k,
                    float *out) {
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = q + r * k;
        float s = scale[r], *dst = out + r * k;
        for (int64_t i = 0; i < k; i++) dst[i] = table[row[i]] * s;
    }
}

/* The native decode path's entry (common.h's MatvecFn): y[r] = scale[r] * sum_i table[q[r][i]] x[i]
 * for one float32 row, each weight byte read once. */
typedef struct {
    const uint8_t *q;
    const float *scale, *table;
    int64_t n, k;
} Fp8Matvec;

EXPORT_SIZE(Fp8Matvec)

#ifdef FP8_AVX2
/* 16 e4m3 bytes as float16 bit patterns: sign to bit 15, exponent and mantissa shifted up by 7, so
 * each float16 is the e4m3 value times 2^-8 (its exponent bias is 8 more), subnormals included; the
 * F16C conversion then widens them exactly. */
INLINE void widen16(const uint8_t *p, __m256 *lo, __m256 *hi) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(0x3f80)),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
#endif

int fp8_matvec(const void *desc, const float *x, float *y) {
    const Fp8Matvec *d = desc;
    const int64_t k = d->k;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < d->n; r++) {
        const uint8_t *row = d->q + r * k;
        float sum = 0.0f;
        int64_t i = 0;
#ifdef FP8_AVX2
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (; i + 16 <= k; i += 16) {
            __m256 lo, hi;
            widen16(row + i, &lo, &hi);
            a0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + i), a0);
            a1 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + i + 8), a1);
        }
        sum = hsum8(_mm256_add_ps(a0, a1)) * 256.0f;
#endif
        for (; i < k; i++) sum += d->table[row[i]] * x[i];
        y[r] = sum * d->scale[r];
    }
    return 0;
}
