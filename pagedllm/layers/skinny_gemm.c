/* y = x W^T (+ bias) for a few rows of x (a decode batch, or one request's draft verification),
 * streaming the weight W [n, k] from memory once.
 *
 * With 1 to 8 rows a product is bound by reading W. The BLAS GEMM the framework calls for 2 or more
 * rows packs W first (an extra write and read of the whole matrix) or runs one matrix-vector product
 * per row: on a 2-core AVX2 machine the [k+1, 576] x [576, 49152] LM-head product took 19-29 ms for
 * 2-8 rows against 8 ms for one row, which makes verifying drafted tokens cost 2-3 decode steps.
 * Here each weight row is loaded once and multiplied into every input row while it sits in
 * registers (the inputs, converted to float once, stay in L1).
 *
 * Every output element is the same sequence of float operations whatever the number of rows (one
 * vector accumulator over the row in order, then a fixed tree over its lanes): a row's result does
 * not depend on the rows computed beside it, so verifying drafts scores exactly what one-token
 * steps score. Reassociation is switched off here for that reason (the build passes
 * -fassociative-math, which could split the accumulator differently per row count).
 *
 * Built by skinny_gemm.py with the flags of cpu_decode.py; loaded with ctypes.
 */
#include "../attention/backends/cpu_decode.c"

#pragma GCC optimize("no-associative-math")

#define MAX_ROWS 8
/* Input rows that share one pass over a weight row (their accumulators stay in registers). */
#define GROUP 4
/* Output rows per work item: consecutive rows, so each thread streams one contiguous range. */
#define BLOCK 16

/* 8 floats: one AVX2 register (the 16-float `vec` of the attention kernel is split through memory
 * on CPUs without AVX-512, which kept the accumulators out of registers). A dot product runs two of
 * them, even and odd halves of each 16 elements, summed at the end. */
typedef float oct __attribute__((vector_size(32)));
typedef uint16_t oct_bf16 __attribute__((vector_size(16)));
typedef uint32_t oct_words __attribute__((vector_size(32)));
typedef float quad __attribute__((vector_size(16)));

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

/* The 16 lanes of (lo, hi) summed as a fixed tree. */
INLINE float tree_sum(oct lo, oct hi) {
    const oct h = lo + hi;
    quad a, b;
    memcpy(&a, &h, sizeof a);
    memcpy(&b, (const char *)&h + sizeof a, sizeof b);
    const quad q = a + b;
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* Output column j of rows [first, first + G) of x: xs holds the inputs as float rows of kp (k
 * rounded up to LANES, zero-padded) elements. G and bf16 are constants in each copy, so the
 * accumulators live in registers. */
INLINE void group_dots(const char *w_row, const float *xs, int64_t kp, int64_t first, const int64_t G,
                       const void *bias, char *y, int64_t n, int64_t j, int64_t k, const int bf16) {
    const int64_t full = k / LANES * LANES, elem = bf16 ? 2 : 4;
    oct lo[GROUP], hi[GROUP];
#pragma GCC unroll 4
    for (int64_t r = 0; r < G; r++) lo[r] = hi[r] = (oct){0};
    for (int64_t c = 0; c < kp; c += LANES) {
        oct w_lo, w_hi;
        if (c < full) {
            w_lo = load_oct(w_row + c * elem, bf16);
            w_hi = load_oct(w_row + (c + LANES / 2) * elem, bf16);
        } else {
            /* The row's last k - full elements, zero-padded like the inputs. */
            float tail[LANES] = {0};
            for (int64_t t = c; t < k; t++)
                tail[t - c] = bf16 ? bf16_to_float(((const uint16_t *)w_row)[t]) : ((const float *)w_row)[t];
            memcpy(&w_lo, tail, sizeof w_lo);
            memcpy(&w_hi, tail + LANES / 2, sizeof w_hi);
        }
#pragma GCC unroll 4
        for (int64_t r = 0; r < G; r++) {
            oct x_lo, x_hi;
            memcpy(&x_lo, xs + (first + r) * kp + c, sizeof x_lo);
            memcpy(&x_hi, xs + (first + r) * kp + c + LANES / 2, sizeof x_hi);
            lo[r] += w_lo * x_lo;
            hi[r] += w_hi * x_hi;
        }
    }
#pragma GCC unroll 4
    for (int64_t r = 0; r < G; r++) {
        float s = tree_sum(lo[r], hi[r]);
        if (bias) s += bf16 ? bf16_to_float(((const uint16_t *)bias)[j]) : ((const float *)bias)[j];
        store_row(y, (first + r) * n + j, s, bf16);
    }
}

INLINE int skinny(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int64_t m, int64_t n,
                  int64_t k, const int bf16) {
    if (m < 1 || m > MAX_ROWS || n < 1 || k < 1) return -1;
    const int64_t kp = (k + LANES - 1) / LANES * LANES, elem = bf16 ? 2 : 4;
    float *xs = calloc((size_t)(m * kp), sizeof(float));
    if (!xs) return -2;
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = 0; c < k; c++)
            xs[i * kp + c] = bf16 ? bf16_to_float(((const uint16_t *)x)[i * x_stride + c])
                                  : ((const float *)x)[i * x_stride + c];
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        for (int64_t j = b * BLOCK; j < end; j++) {
            const char *w_row = (const char *)w + j * k * elem;
            for (int64_t first = 0; first < m; first += GROUP) {
                switch (m - first < GROUP ? m - first : GROUP) {
                case 1: group_dots(w_row, xs, kp, first, 1, bias, y, n, j, k, bf16); break;
                case 2: group_dots(w_row, xs, kp, first, 2, bias, y, n, j, k, bf16); break;
                case 3: group_dots(w_row, xs, kp, first, 3, bias, y, n, j, k, bf16); break;
                default: group_dots(w_row, xs, kp, first, 4, bias, y, n, j, k, bf16); break;
                }
            }
        }
    }
    free(xs);
    return 0;
}

/* y [m, n] = x [m, k] (row stride x_stride) W [n, k]^T (+ bias [n], or NULL), all of one element
 * type (float32 or bfloat16; sums in float, each output rounded once); W, bias and y contiguous.
 * Returns 0, or -1 for shapes outside 1 <= m <= MAX_ROWS, -2 when out of memory. */
int skinny_gemm_f32(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int64_t m, int64_t n,
                    int64_t k) {
    return skinny(x, x_stride, w, bias, y, m, n, k, 0);
}

int skinny_gemm_bf16(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int64_t m,
                     int64_t n, int64_t k) {
    return skinny(x, x_stride, w, bias, y, m, n, k, 1);
}

int skinny_gemm_max_rows(void) { return MAX_ROWS; }
