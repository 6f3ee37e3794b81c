/* y = x W^T (+ bias) for bfloat16 x [m, k] and W [n, k], any number of rows, where every output element
 * is the same sequence of operations whatever the number of rows, the row's place among them and the
 * number of threads: a token's products are bitwise the same alone, in any batch, in a prompt chunk of
 * any length or as a decode row (the batch invariance the native model body builds on).
 *
 * The order, fixed: output (i, j) is sixteen float lanes, lane l the chain over the k in 32-element
 * chunks c = 0, 1, ... of `vdpbf16ps` (lane l += x[i, 32c + 2l] w[j, 32c + 2l] + x[i, 32c + 2l + 1]
 * w[j, 32c + 2l + 1], the products exact, a ragged last chunk read as zeros), then the lanes summed by
 * reduce_lanes's tree (halves, quarters, ... of the vector), then the bias (in float), then one
 * rounding to bfloat16 (or none: float32 out, for logits). Only how many (rows, columns) chains run
 * side by side changes with the shape, never a chain.
 *
 * Shapes: up to STREAM_ROWS rows (decode steps, verification) are bound by reading W: each weight row
 * is read once, start to end, and multiplied into every input row while in registers (several weight
 * rows at once as separate streams read DRAM at a fifth of the rate here). More rows are bound by the
 * multiplies: a work item is 16 columns, whose weight rows stay in cache while tiles of TILE_ROWS
 * input rows x TILE_COLS columns run through them. Threads split the columns (contiguous ranges).
 *
 * In the dense kernel library (kernels/build.py), called by the native model body (llama_decode.c)
 * and by its Python binding (layers/bf16_gemm.py).
 */
#include "bf16_gemm.h"
#include "vec.h"

/* The chains are intrinsics (never reassociated); the lane tree's sums must stay as written. */
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

#define STREAM_ROWS 8

#if defined(__AVX512BF16__) && LANES == 16
#define BF16_GEMM_SUPPORTED 1
#define TILE_ROWS 4
#define TILE_COLS 4
#define BLOCK_ROWS 128 /* a multiple of TILE_ROWS */

/* Mask of the first `count` (< 32) 16-bit elements of a chunk. */
INLINE __mmask32 ragged(int64_t count) { return (__mmask32)((1u << count) - 1u); }

/* Chains of rows x cols outputs over all k: rows of x at `x` (stride xs), weight rows at `w`
 * (contiguous, k each); lanes[r * 16 + col0 + j] gets (row r, column j)'s lanes. */
INLINE void chains(const uint16_t *x, int64_t xs, const uint16_t *w, int64_t k, vec *lanes, int64_t col0,
                   const int rows, const int cols) {
    __m512 acc[STREAM_ROWS][TILE_COLS];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int j = 0; j < cols; j++) acc[r][j] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 32 <= k; c += 32) {
        __m512i xv[STREAM_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) xv[r] = _mm512_loadu_si512(x + r * xs + c);
#pragma GCC unroll 4
        for (int j = 0; j < cols; j++) {
            const __m512i wv = _mm512_loadu_si512(w + j * k + c);
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv, (__m512bh)xv[r]);
        }
    }
    if (c < k) {
        const __mmask32 m = ragged(k - c);
        __m512i xv[STREAM_ROWS];
        for (int r = 0; r < rows; r++) xv[r] = _mm512_maskz_loadu_epi16(m, x + r * xs + c);
        for (int j = 0; j < cols; j++) {
            const __m512i wv = _mm512_maskz_loadu_epi16(m, w + j * k + c);
            for (int r = 0; r < rows; r++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv, (__m512bh)xv[r]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) memcpy(&lanes[r * 16 + col0 + j], &acc[r][j], sizeof(vec));
}

/* Rows [0, rows) x columns [0, cols) (cols <= 16) of the block at x, w, y: the chains, then each row's
 * 16 lane vectors summed by one transpose tree, the bias added and the results stored (every step
 * lane-wise, so each output is the scalar sequence the file's comment gives). */
INLINE void finish(const vec *lanes, int64_t rows, int64_t cols, const uint16_t *bias, void *y, int64_t y_stride,
                   int float_out) {
    vec b = {0};
    for (int64_t j = 0; bias && j < cols; j++) b[j] = bf16_to_float(bias[j]);
    for (int64_t r = 0; r < rows; r++) {
        vec padded[16];
        const vec *row = lanes + r * 16;
        if (cols < 16) {
            memcpy(padded, row, (size_t)cols * sizeof(vec));
            for (int64_t j = cols; j < 16; j++) padded[j] = (vec){0};
            row = padded;
        }
        const vec s = bias ? reduce_lanes(row, 0) + b : reduce_lanes(row, 0);
        if (float_out) {
            memcpy((float *)y + r * y_stride, &s, (size_t)cols * sizeof(float));
        } else {
            const bf16_vec h = vec_to_bf16(s);
            memcpy((uint16_t *)y + r * y_stride, &h, (size_t)cols * sizeof(uint16_t));
        }
    }
}

/* The chains of all `rows` (<= STREAM_ROWS) rows against weight rows [0, cols), one weight row at a
 * time (one stream through W). */
INLINE void stream_rows(const uint16_t *x, int64_t xs, const uint16_t *w, int64_t k, vec *lanes, int64_t cols,
                        const int rows) {
    for (int64_t j = 0; j < cols; j++) chains(x, xs, w + j * k, k, lanes, j, rows, 1);
}

/* The chains of `rows` (<= TILE_ROWS) rows against weight rows [0, cols), TILE_COLS at a time. */
INLINE void tile_rows(const uint16_t *x, int64_t xs, const uint16_t *w, int64_t k, vec *lanes, int64_t cols,
                      const int rows) {
    int64_t j = 0;
    for (; j + TILE_COLS <= cols; j += TILE_COLS) chains(x, xs, w + j * k, k, lanes, j, rows, TILE_COLS);
    for (; j < cols; j++) chains(x, xs, w + j * k, k, lanes, j, rows, 1);
}

static void bf16_gemm_any(const uint16_t *x, int64_t xs, const uint16_t *w, const uint16_t *bias, void *y,
                          int64_t m, int64_t n, int64_t k, int float_out) {
    const int64_t groups = (n + 15) / 16, elem = float_out ? 4 : 2;
    /* Many rows go BLOCK_ROWS at a time through every column group, so a block's x stays in L2 while
     * the groups' weight rows pass (a long prompt's whole x, read again for every group, does not fit
     * there). Only the order of work items changes, never an output's chain. */
    const int64_t blocks = m <= STREAM_ROWS ? 1 : (m + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t j0 = g * 16, cols = n - j0 < 16 ? n - j0 : 16;
        const uint16_t *wg = w + j0 * k, *bg = bias ? bias + j0 : NULL;
        vec lanes[STREAM_ROWS * 16];
        if (m <= STREAM_ROWS) {
            switch (m) {
#define STREAM(R)                                    \
    case R:                                          \
        stream_rows(x, xs, wg, k, lanes, cols, R); \
        break;
                STREAM(1) STREAM(2) STREAM(3) STREAM(4) STREAM(5) STREAM(6) STREAM(7) STREAM(8)
#undef STREAM
            }
            finish(lanes, m, cols, bg, (char *)y + j0 * elem, n, float_out);
            continue;
        }
        const int64_t end = (b + 1) * BLOCK_ROWS < m ? (b + 1) * BLOCK_ROWS : m;
        for (int64_t i = b * BLOCK_ROWS; i < end; i += TILE_ROWS) {
            const int64_t rows = end - i < TILE_ROWS ? end - i : TILE_ROWS;
            const uint16_t *xi = x + i * xs;
            switch (rows) {
            case 1: tile_rows(xi, xs, wg, k, lanes, cols, 1); break;
            case 2: tile_rows(xi, xs, wg, k, lanes, cols, 2); break;
            case 3: tile_rows(xi, xs, wg, k, lanes, cols, 3); break;
            default: tile_rows(xi, xs, wg, k, lanes, cols, TILE_ROWS); break;
            }
            finish(lanes, rows, cols, bg, (char *)y + (i * n + j0) * elem, n, float_out);
        }
    }
}
#else
#define BF16_GEMM_SUPPORTED 0
#endif

int bf16_gemm(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int64_t m, int64_t n,
              int64_t k, int float_out) {
#if BF16_GEMM_SUPPORTED
    if (m < 1 || n < 1 || k < 1) return -1;
    bf16_gemm_any(x, x_stride, w, bias, y, m, n, k, float_out);
    return 0;
#else
    (void)x, (void)x_stride, (void)w, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)float_out;
    return -1;
#endif
}

int bf16_gemm_supported(void) { return BF16_GEMM_SUPPORTED; }

#pragma GCC pop_options
