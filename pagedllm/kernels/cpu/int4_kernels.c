/* 4-bit group-quantized linear layers (AWQ and GPTQ checkpoints, repacked at load by int4.py).
 *
 * The weight W [n, k] is held as w[r][i] = s[r][g] * (q[r][i] - z[r][g]) with g = i / group:
 *   q: uint8 [n, k/2], each 32-element chunk in 16 bytes, byte l holding element l in its low nibble
 *      and element l + 16 in its high nibble (the order one 128-bit load unpacks with a shift and a mask);
 *   s: float16 [n, k/group]; z: uint8 [n, k/group] (0..16: GPTQ's "+1" zeros reach 16).
 *
 * The product of decode (a few activation rows) reads each packed byte once: per group,
 * acc = sum_i q_i x_i in float, then
 *     y_r += s_g * acc  -  s_g * z_g * sum_{i in g} x_i
 * (the activation group sums are computed once per call). One activation row widens the nibbles to
 * float in registers; several rows share each weight row widened once into a per-thread buffer of k
 * floats (cache-resident), never the whole weight. Activations stay float32: the result is the
 * float product of the dequantized weight up to summation order. Paths: AVX2 + FMA, and portable C
 * that is only slower.
 *
 * Also: rows dequantized to float32 or bfloat16, the tiles of the batched path (int4.py multiplies them
 * with torch's GEMM). Built by kernels/build.py into the int4 kernel library; bindings:
 * layers/quant/int4_native.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#define INT4_AVX2 1
#endif

INLINE float scale_at(const uint16_t *s, int64_t i) { return rd_f16((const uint8_t *)(s + i)); }

#ifdef INT4_AVX2
/* The 32 nibbles of a chunk as four vectors of 8 floats, in element order. */
INLINE void unpack_chunk(const uint8_t *p, __m256 f[4]) {
    __m128i v = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0xF);
    __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
#endif

#ifdef INT4_AVX2
/* sum_i w[r][i] x[i] for one packed row (k / 2 bytes) and one activation row with its group sums:
 * the single-row product, nibbles widened and multiplied in registers. */
static float dot_row(const uint8_t *q, const uint16_t *s, const uint8_t *z, int64_t k, int64_t group,
                     const float *x, const float *xsum) {
    int64_t groups = k / group, chunks = group / 32;
    float offset = 0.0f;
    __m256 total = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        /* Four accumulators: the chunk's multiply-adds do not wait on each other. */
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t at = g * group + 32 * c;
            __m256 f[4];
            unpack_chunk(q + at / 2, f);
            for (int j = 0; j < 4; j++) a[j] = _mm256_fmadd_ps(f[j], _mm256_loadu_ps(x + at + 8 * j), a[j]);
        }
        float sg = scale_at(s, g);
        __m256 acc = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
        total = _mm256_fmadd_ps(acc, _mm256_set1_ps(sg), total);
        offset += sg * z[g] * xsum[g];
    }
    return hsum8(total) - offset;
}
#endif

/* The 4-bit values of one packed row as floats (q, before scale and zero), for several products. */
static void unpack_row(const uint8_t *q, int64_t k, float *out) {
    for (int64_t at = 0; at < k; at += 32) {
#ifdef INT4_AVX2
        __m256 f[4];
        unpack_chunk(q + at / 2, f);
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + at + 8 * j, f[j]);
#else
        for (int l = 0; l < 16; l++) {
            out[at + l] = q[at / 2 + l] & 0xF;
            out[at + l + 16] = q[at / 2 + l] >> 4;
        }
#endif
    }
}

/* sum_i w[r][i] x[i] from the row's values unpacked by unpack_row, its scales and zeros. */
static float dot_unpacked(const float *qf, const uint16_t *s, const uint8_t *z, int64_t k, int64_t group,
                          const float *x, const float *xsum) {
    float total = 0.0f, offset = 0.0f;
    for (int64_t g = 0; g < k / group; g++) {
        const float *qg = qf + g * group, *xg = x + g * group;
#ifdef INT4_AVX2
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t i = 0; i < group; i += 32)
            for (int j = 0; j < 4; j++)
                a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i + 8 * j), _mm256_loadu_ps(xg + i + 8 * j), a[j]);
        float acc = hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
#else
        float acc = 0.0f;
        for (int64_t i = 0; i < group; i++) acc += qg[i] * xg[i];
#endif
        float sg = scale_at(s, g);
        total += sg * acc;
        offset += sg * z[g] * xsum[g];
    }
    return total - offset;
}

/* y[m, r] = sum_i x[m, i] w[r][i] for m < M (x contiguous [M, k], y rows of stride ldy), float32.
 * Returns -1 when the group is not a multiple of 32 or does not divide k. */
int int4_matmul(const uint8_t *q, const uint16_t *s, const uint8_t *z, int64_t n, int64_t k, int64_t group,
                const float *x, int64_t M, float *y, int64_t ldy) {
    if (group <= 0 || group % 32 || k % group) return -1;
    int64_t groups = k / group;
    float *xsum = malloc((M * groups + 1) * sizeof(float));
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            float t = 0.0f;
            for (int64_t i = 0; i < group; i++) t += x[m * k + g * group + i];
            xsum[m * groups + g] = t;
        }
#pragma omp parallel
    {
        /* Several rows of x: each weight row is unpacked once for all of them. */
        float *qf = malloc(k * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            const uint8_t *qr = q + r * (k / 2);
            const uint16_t *sr = s + r * groups;
            const uint8_t *zr = z + r * groups;
#ifdef INT4_AVX2
            if (M == 1) {
                y[r] = dot_row(qr, sr, zr, k, group, x, xsum);
                continue;
            }
#endif
            unpack_row(qr, k, qf);
            for (int64_t m = 0; m < M; m++)
                y[m * ldy + r] = dot_unpacked(qf, sr, zr, k, group, x + m * k, xsum + m * groups);
        }
        free(qf);
    }
    free(xsum);
    return 0;
}

/* Rows [0, n) of the weight dequantized into out [n, k] (bfloat16 when out_bf16, else float32).
 * Returns -1 when the group is not a multiple of 32 or does not divide k. One thread: a tile of the
 * batched product (tiles.py) is cheaper than waking a second one on a busy machine. */
int int4_dequantize_rows(const uint8_t *q, const uint16_t *s, const uint8_t *z, int64_t n, int64_t k,
                         int64_t group, void *out, int out_bf16) {
    if (group <= 0 || group % 32 || k % group) return -1;
    int64_t groups = k / group;
    float *row = out_bf16 ? malloc(k * sizeof(float)) : NULL;
    for (int64_t r = 0; r < n; r++) {
        float *dst = out_bf16 ? row : (float *)out + r * k;
        const uint8_t *p = q + r * (k / 2);
        for (int64_t g = 0; g < groups; g++) {
            float sg = scale_at(s, r * groups + g), mg = -sg * z[r * groups + g];
            for (int64_t at = g * group; at < (g + 1) * group; at += 32)
                for (int l = 0; l < 16; l++) {
                    dst[at + l] = sg * (p[at / 2 + l] & 0xF) + mg;
                    dst[at + l + 16] = sg * (p[at / 2 + l] >> 4) + mg;
                }
        }
        if (out_bf16)
            for (int64_t i = 0; i < k; i++) ((uint16_t *)out)[r * k + i] = float_to_bf16(row[i]);
    }
    free(row);
    return 0;
}

/* Which vector path this build has: 1 AVX2 + FMA, 0 portable C. */
int int4_kernel_isa(void) {
#ifdef INT4_AVX2
    return 1;
#else
    return 0;
#endif
}

/* The native decode path's entry (common.h's MatvecFn): y = W x for one float32 row, the input
 * first gathered by the act-order permutation `perm` (int64 [k], NULL: none) as int4.py gathers it. */
typedef struct {
    const uint8_t *q;
    const uint16_t *s;
    const uint8_t *z;
    int64_t n, k, group;
    const int64_t *perm;
} Int4Matvec;

EXPORT_SIZE(Int4Matvec)

int int4_matvec(const void *desc, const float *x, float *y) {
    const Int4Matvec *d = desc;
    float *gathered = NULL;
    if (d->perm) {
        gathered = malloc(d->k * sizeof(float));
        if (!gathered) return -2;
        for (int64_t i = 0; i < d->k; i++) gathered[i] = x[d->perm[i]];
        x = gathered;
    }
    const int status = int4_matmul(d->q, d->s, d->z, d->n, d->k, d->group, x, 1, y, d->n);
    free(gathered);
    return status;
}
