/* y = x W^T (+ bias) for a few rows of x (a decode batch, or one request's draft verification),
 * streaming the weight W [n, k] from memory once.
 *
 * With 1 to 8 rows a product is bound by reading W. The BLAS GEMM the framework calls for 2 or more
 * rows packs W first (an extra write and read of the whole matrix) or runs one matrix-vector product
 * per row, so verifying drafted tokens cost several decode steps (figures: benchmarks/RESULTS.md,
 * "Figures behind code choices").
 * Here each weight row is loaded once and multiplied into every input row while it sits in
 * registers (the inputs, converted to float once, stay in L1).
 *
 * Every output element is the same sequence of float operations whatever the number of rows (one
 * vector accumulator over the row in order, then a fixed tree over its lanes): a row's result does
 * not depend on the rows computed beside it, so verifying drafts scores exactly what one-token
 * steps score. Reassociation is switched off in this translation unit for that reason (the build
 * passes -fassociative-math, which could split the accumulator differently per row count).
 *
 * Built into the dense kernel library by kernels/build.py; bindings: layers/skinny_gemm.py.
 */
#pragma GCC optimize("no-associative-math")

#include <stdlib.h>

#include "common.h"
#include "skinny_gemm.h"

/* Elements per chunk: one AVX2 register of floats. */
#define CHUNK 8
/* Output rows per work item: consecutive rows, so each thread streams one contiguous range. */
#define BLOCK 16

/* 8 floats: one AVX2 register, whatever the build's target. One accumulator per input row:
 * 8 rows take 8 registers beside the weight chunk, so every row is served in one pass over the
 * weight row (a second pass from L1 stalled the memory stream: 5 rows cost 1.3x 4). */
typedef float8 oct;
typedef uint16_t oct_bf16 __attribute__((vector_size(16)));
typedef uint32_t oct_words __attribute__((vector_size(32)));

INLINE oct load_oct(const char *p, const int bf16) {
    oct f;
    if (bf16) {
        oct_bf16 h;
        memcpy(&h, p, sizeof h);
        const oct_words w = __builtin_convertvector(h, oct_words) << 16;
        memcpy(&f, &w, sizeof f);
    } else {
        memcpy(&f, p, sizeof f);
    }
    return f;
}

/* Output column j of the m (a constant in each copy, so the accumulators live in registers) rows
 * of x: xs holds them as float rows of kp (k rounded up to CHUNK, zero-padded) elements. */
INLINE void row_dots(const char *w_row, const float *xs, int64_t kp, const int64_t m, const void *bias, char *y,
                     int64_t n, int64_t j, int64_t k, const int bf16) {
    const int64_t full = k / CHUNK * CHUNK, elem = bf16 ? 2 : 4;
    oct acc[MAX_ROWS];
#pragma GCC unroll 8
    for (int64_t r = 0; r < m; r++) acc[r] = (oct){0};
    for (int64_t c = 0; c < kp; c += CHUNK) {
        oct w;
        if (c < full) {
            w = load_oct(w_row + c * elem, bf16);
        } else {
            /* The row's last k - full elements, zero-padded like the inputs. */
            float tail[CHUNK] = {0};
            for (int64_t t = c; t < k; t++) tail[t - c] = load_elem(w_row, t, bf16);
            memcpy(&w, tail, sizeof w);
        }
#pragma GCC unroll 8
        for (int64_t r = 0; r < m; r++) {
            oct x;
            memcpy(&x, xs + r * kp + c, sizeof x);
            acc[r] += w * x;
        }
    }
#pragma GCC unroll 8
    for (int64_t r = 0; r < m; r++) {
        float s = hsum8(acc[r]);
        if (bias) s += load_elem(bias, j, bf16);
        store_elem(y, r * n + j, s, bf16);
    }
}

#define ROW_DOTS(M) row_dots(w_row, xs, kp, M, bias, y, n, j, k, bf16)

INLINE int skinny(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int64_t m, int64_t n,
                  int64_t k, const int bf16) {
    if (m < 1 || m > MAX_ROWS || n < 1 || k < 1) return -1;
    const int64_t kp = (k + CHUNK - 1) / CHUNK * CHUNK, elem = bf16 ? 2 : 4;
    float *xs = calloc((size_t)(m * kp), sizeof(float));
    if (!xs) return -2;
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = 0; c < k; c++)
            xs[i * kp + c] = load_elem(x, i * x_stride + c, bf16);
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        for (int64_t j = b * BLOCK; j < end; j++) {
            const char *w_row = (const char *)w + j * k * elem;
            switch (m) {
            case 1: ROW_DOTS(1); break;
            case 2: ROW_DOTS(2); break;
            case 3: ROW_DOTS(3); break;
            case 4: ROW_DOTS(4); break;
            case 5: ROW_DOTS(5); break;
            case 6: ROW_DOTS(6); break;
            case 7: ROW_DOTS(7); break;
            default: ROW_DOTS(8); break;
            }
        }
    }
    free(xs);
    return 0;
}

int skinny_gemm_f32(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int64_t m, int64_t n,
                    int64_t k) {
    return skinny(x, x_stride, w, bias, y, m, n, k, 0);
}

int skinny_gemm_bf16(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int64_t m,
                     int64_t n, int64_t k) {
    return skinny(x, x_stride, w, bias, y, m, n, k, 1);
}

int skinny_gemm_max_rows(void) { return MAX_ROWS; }
