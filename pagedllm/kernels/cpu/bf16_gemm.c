/* y = x W^T (+ bias) for bfloat16 x [m, k] and W [n, k], any number of rows, where every output element
 * is the same sequence of operations whatever the number of rows, the row's place among them and the
 * number of threads: a token's products are bitwise the same alone, in any batch, in a prompt chunk of
 * any length or as a decode row (the batch invariance the native model body builds on).
 *
 * The order, fixed: output (i, j) is one float chain over the k-pairs p = 0, 1, ... in order, each step
 * one `vdpbf16ps` lane (acc += x[i, 2p] w[j, 2p] + x[i, 2p + 1] w[j, 2p + 1], the products exact; an
 * odd k's last pair has zeros for its missing elements), then the bias (in float), then one rounding to
 * bfloat16 (or none: float32 out, for logits). A vector lane is a column: 16 columns' chains advance
 * together, with x's pair broadcast ("outer-product" order, as oneDNN's bf16 GEMMs run, so no
 * horizontal sum is needed). Only how many chains run side by side changes with the shape, never a
 * chain; threads split the work items, never a chain.
 *
 * The weights are W's rows, so a step needs 16 rows' pair p side by side: 16 rows x 16 pairs are
 * transposed in registers (transpose_pairs). Shapes:
 * - up to STREAM_ROWS rows (decode steps, verification) are bound by reading W, each weight element is
 *   read once: a work item is 16 columns, transposed 32 k at a time straight into the chains.
 * - more rows are bound by the multiplies: a work item is PANEL columns x up to BLOCK_ROWS rows; it
 *   packs its columns once into a buffer of pairs ([k/2][PANEL] 32-bit pairs, L2-sized), then tiles of
 *   TILE_ROWS rows run the whole chain in registers, each step one load per 16 columns and one
 *   broadcast per row for 2 x TILE_ROWS products.
 *
 * In the dense kernel library (kernels/build.py), called by the native model body (llama_decode.c)
 * and by its Python binding (layers/bf16_gemm.py).
 */
#include <stdlib.h>

#include "bf16_gemm.h"
#include "vec.h"

#define STREAM_ROWS 8

#if defined(__AVX512BF16__) && LANES == 16
#define BF16_GEMM_SUPPORTED 1
#define PANEL 32      /* columns of a many-row work item: two vectors */
#define TILE_ROWS 8 /* 16 accumulators; 10-12 rows (up to 24) ran slower (benchmarks/RESULTS.md) */
/* Rows per work item: a block packs its panels once and reads W once, so blocks are large; threads
 * still split the panels. */
#define BLOCK_ROWS 512

/* Mask of the first `count` (< 32) 16-bit elements of a chunk. */
INLINE __mmask32 ragged(int64_t count) { return (__mmask32)((1u << count) - 1u); }

/* x's pair p as a 32-bit value in every lane; the half pair past an odd k's end has a zero high half. */
INLINE __m512i x_pair(const uint16_t *x, int64_t p) {
    uint32_t v;
    memcpy(&v, x + 2 * p, sizeof v);
    return _mm512_set1_epi32((int)v);
}

INLINE __m512i x_half_pair(const uint16_t *x, int64_t p) { return _mm512_set1_epi32((int)x[2 * p]); }

/* r[i] = 16 pairs of weight row i; afterwards r[p] = pair p of rows 0..15 (a 16 x 16 transpose of 32-bit
 * elements: pairs within 128-bit lanes, then the lanes across vectors). */
INLINE void transpose_pairs(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* b[4i + q], 128-bit lane L: pair 4L + q of rows 4i..4i+3 */
    for (int i = 0; i < 4; i++) {
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int q = 0; q < 4; q++) {
        const __m512i c0 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0x44), c1 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0xee);
        const __m512i c2 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0x44);
        const __m512i c3 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0xee);
        r[q] = _mm512_shuffle_i32x4(c0, c2, 0x88);
        r[4 + q] = _mm512_shuffle_i32x4(c0, c2, 0xdd);
        r[8 + q] = _mm512_shuffle_i32x4(c1, c3, 0x88);
        r[12 + q] = _mm512_shuffle_i32x4(c1, c3, 0xdd);
    }
}

/* Pairs [c/2, c/2 + 16) of weight rows [0, cols) (cols <= 16) at w (row stride k), transposed into t:
 * t[p] = pair c/2 + p of the 16 rows, zeros past the rows and past k. */
INLINE void load_pairs(const uint16_t *w, int64_t k, int64_t cols, int64_t c, __m512i t[16]) {
    const __mmask32 m = k - c >= 32 ? (__mmask32)~0u : ragged(k - c);
    for (int i = 0; i < 16; i++)
        t[i] = i < cols ? _mm512_maskz_loadu_epi16(m, w + i * k + c) : _mm512_setzero_si512();
    transpose_pairs(t);
}

/* Output rows [0, m) x columns [0, cols) (cols <= 16) from their chains `acc` (row r at acc[r * step]):
 * the bias, then the store. */
INLINE void finish(const __m512 *acc, int step, int64_t m, int64_t cols, const uint16_t *bias, char *y, int64_t n,
                   int float_out) {
    const __mmask16 keep = cols >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1u);
    const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias)), 16))
                          : _mm512_setzero_ps();
    for (int64_t r = 0; r < m; r++) {
        const __m512 s = bias ? _mm512_add_ps(acc[r * step], b) : acc[r * step];
        if (float_out) {
            _mm512_mask_storeu_ps((float *)y + r * n, keep, s);
        } else {
            vec v;
            memcpy(&v, &s, sizeof v);
            const bf16_vec h = vec_to_bf16(v);
            __m256i hv;
            memcpy(&hv, &h, sizeof hv);
            _mm256_mask_storeu_epi16((uint16_t *)y + r * n, keep, hv);
        }
    }
}

/* The chains of `rows` (<= STREAM_ROWS) rows against weight rows [0, cols) (cols <= 16), into acc.
 * Each step reads 16 rows a cache line apart from the next, a pattern DRAM serves slowly; so while
 * they are read, the next group's rows (`next`, `next_bytes` contiguous, or NULL) are fetched in
 * address order, at the same pace. */
INLINE void stream_rows(const uint16_t *x, int64_t xs, const uint16_t *w, int64_t k, int64_t cols, __m512 *acc,
                        const char *next, int64_t next_bytes, const int rows) {
    __m512 a[STREAM_ROWS];
    for (int r = 0; r < rows; r++) a[r] = _mm512_setzero_ps();
    const int64_t full = k / 2;
    for (int64_t c = 0; c < k; c += 32) {
        if (next)
            for (int64_t line = c / 32 * 16 * 64, i = 0; i < 16 && line < next_bytes; i++, line += 64)
                _mm_prefetch(next + line, _MM_HINT_T0);
        __m512i t[16];
        load_pairs(w, k, cols, c, t);
        const int64_t p0 = c / 2, pairs = full - p0 < 16 ? full - p0 : 16;
        for (int64_t p = 0; p < pairs; p++)
            for (int r = 0; r < rows; r++)
                a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)t[p], (__m512bh)x_pair(x + r * xs, p0 + p));
        if (pairs < 16 && (k & 1))
            for (int r = 0; r < rows; r++)
                a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)t[pairs], (__m512bh)x_half_pair(x + r * xs, full));
    }
    for (int r = 0; r < rows; r++) acc[r] = a[r];
}

/* Weight rows [0, cols) (cols <= PANEL) at w packed as pairs: panel[p * PANEL + j] = pair p of row j,
 * zeros past the rows and past k. */
static void pack_panel(const uint16_t *w, int64_t k, int64_t cols, uint32_t *panel) {
    for (int64_t c = 0; c < k; c += 32) {
        const int64_t pairs = (k - c + 1) / 2 < 16 ? (k - c + 1) / 2 : 16;
        for (int64_t h = 0; h < PANEL; h += 16) {
            __m512i t[16];
            const int64_t left = cols - h < 0 ? 0 : cols - h;
            load_pairs(w + h * k, k, left < 16 ? left : 16, c, t);
            for (int64_t p = 0; p < pairs; p++) _mm512_storeu_si512(panel + (c / 2 + p) * PANEL + h, t[p]);
        }
    }
}

/* The chains of `rows` (<= TILE_ROWS) rows against a packed panel, into acc[r * 2 + half]. */
INLINE void tile_rows(const uint16_t *x, int64_t xs, const uint32_t *panel, int64_t k, __m512 *acc, const int rows) {
    __m512 a[TILE_ROWS][2];
    for (int r = 0; r < rows; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    const int64_t full = k / 2;
    for (int64_t p = 0; p < full; p++) {
        const __m512i w0 = _mm512_loadu_si512(panel + p * PANEL), w1 = _mm512_loadu_si512(panel + p * PANEL + 16);
        for (int r = 0; r < rows; r++) {
            const __m512i xv = x_pair(x + r * xs, p);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)w0, (__m512bh)xv);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)w1, (__m512bh)xv);
        }
    }
    if (k & 1) {
        const __m512i w0 = _mm512_loadu_si512(panel + full * PANEL), w1 = _mm512_loadu_si512(panel + full * PANEL + 16);
        for (int r = 0; r < rows; r++) {
            const __m512i xv = x_half_pair(x + r * xs, full);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)w0, (__m512bh)xv);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)w1, (__m512bh)xv);
        }
    }
    for (int r = 0; r < rows; r++) acc[2 * r] = a[r][0], acc[2 * r + 1] = a[r][1];
}

/* A thread's panel buffer, grown to the largest k it has packed and kept for the next call (OpenMP's
 * pool threads live as long as the process; one buffer each, k / 2 x PANEL pairs). */
static uint32_t *panel_buffer(int64_t k) {
    static __thread uint32_t *buffer;
    static __thread int64_t capacity;
    const int64_t need = (k + 1) / 2 * PANEL;
    if (need > capacity) {
        free(buffer);
        buffer = aligned_alloc(64, (size_t)need * sizeof(uint32_t));
        capacity = buffer ? need : 0;
    }
    return buffer;
}

static int bf16_gemm_streamed(const uint16_t *x, int64_t xs, const uint16_t *w, const uint16_t *bias, char *y,
                              int64_t m, int64_t n, int64_t k, int float_out) {
    const int64_t groups = (n + 15) / 16, elem = float_out ? 4 : 2;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t j0 = g * 16, cols = n - j0 < 16 ? n - j0 : 16;
        const int64_t next_cols = n - j0 - 16 < 16 ? n - j0 - 16 : 16;
        const char *next = next_cols > 0 ? (const char *)(w + (j0 + 16) * k) : NULL;
        const int64_t next_bytes = next_cols * k * 2;
        __m512 acc[STREAM_ROWS];
        switch (m) {
#define STREAM(R)                                                          \
    case R:                                                                \
        stream_rows(x, xs, w + j0 * k, k, cols, acc, next, next_bytes, R); \
        break;
            STREAM(1) STREAM(2) STREAM(3) STREAM(4) STREAM(5) STREAM(6) STREAM(7) STREAM(8)
#undef STREAM
        }
        finish(acc, 1, m, cols, bias ? bias + j0 : NULL, y + j0 * elem, n, float_out);
    }
    return 0;
}

static int bf16_gemm_tiled(const uint16_t *x, int64_t xs, const uint16_t *w, const uint16_t *bias, char *y,
                           int64_t m, int64_t n, int64_t k, int float_out) {
    const int64_t panels = (n + PANEL - 1) / PANEL, elem = float_out ? 4 : 2;
    /* Rows split evenly among the blocks, whole tiles each (a last block of a few rows runs narrow tiles). */
    const int64_t blocks = (m + BLOCK_ROWS - 1) / BLOCK_ROWS;
    const int64_t block_rows = ((m + blocks - 1) / blocks + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t g = 0; g < panels; g++) {
            uint32_t *panel = panel_buffer(k);
            if (!panel) {
                failed = 1;
                continue;
            }
            const int64_t j0 = g * PANEL, cols = n - j0 < PANEL ? n - j0 : PANEL;
            pack_panel(w + j0 * k, k, cols, panel);
            const int64_t end = (b + 1) * block_rows < m ? (b + 1) * block_rows : m;
            for (int64_t i = b * block_rows; i < end; i += TILE_ROWS) {
                const int64_t rows = end - i < TILE_ROWS ? end - i : TILE_ROWS;
                const uint16_t *xi = x + i * xs;
                __m512 acc[2 * TILE_ROWS];
                switch (rows) {
#define TILE(R)                                   \
    case R:                                       \
        tile_rows(xi, xs, panel, k, acc, R); \
        break;
                    TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
#undef TILE
                }
                for (int64_t h = 0; h < 2 && h * 16 < cols; h++) {
                    const int64_t c = cols - h * 16 < 16 ? cols - h * 16 : 16;
                    finish(acc + h, 2, rows, c, bias ? bias + j0 + h * 16 : NULL, y + (i * n + j0 + h * 16) * elem, n,
                           float_out);
                }
            }
        }
    return failed ? -2 : 0;
}
#else
#define BF16_GEMM_SUPPORTED 0
#endif

int bf16_gemm(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int64_t m, int64_t n,
              int64_t k, int float_out) {
#if BF16_GEMM_SUPPORTED
    if (m < 1 || n < 1 || k < 1) return -1;
    if (m <= STREAM_ROWS) return bf16_gemm_streamed(x, x_stride, w, bias, y, m, n, k, float_out);
    return bf16_gemm_tiled(x, x_stride, w, bias, y, m, n, k, float_out);
#else
    (void)x, (void)x_stride, (void)w, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)float_out;
    return -1;
#endif
}

int bf16_gemm_supported(void) { return BF16_GEMM_SUPPORTED; }
