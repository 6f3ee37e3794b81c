/* The many-row (prompt) product of GGUF layers on CPUs with AVX512-BF16: panels of weight rows
 * dequantized to bfloat16 into a buffer that stays in the core's L2 cache, then multiplied with every
 * activation row by `vdpbf16ps` (32 bf16 products a instruction, float32 sums).
 *
 * A panel is NP weight rows (output columns) by all k, stored pair-interleaved as the instruction
 * reads it: 32-bit unit (p, n) holds elements 2p and 2p+1 of weight row n, so one 64-byte load is two
 * k-steps of 16 columns. Each panel is dequantized once per call and reused by all M rows in blocks
 * of MR rows: the block's MR x NP float32 sums stay in registers over the whole k, each activation
 * pair broadcast once for the NP columns. The dequantization (once per weight per call) is spread over
 * the M rows; the int8 kernel of gguf_kernels.c stays the path for few rows (gguf.py picks).
 *
 * The weights are rounded to bfloat16 (to nearest even) as a bf16 model's are: the same values the
 * bf16 tiles of the torch path (tiles.py) hold. Without AVX512-BF16 in the build the entry returns -3
 * and the caller keeps that path.
 * Built by kernels/build.py into the gguf kernel library; bindings: layers/quant/gguf_native.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include "gguf_blocks.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_PANELS 1

/* Panel width (weight rows) for rows of k elements: the pair-interleaved panel (NP x k bf16) within
 * PANEL_BYTES, so that it stays in L2 while every row block reads it; 16 to 64 in steps of 16. */
#define PANEL_BYTES (512 << 10)
static int panel_width(int64_t k) {
    int64_t np = PANEL_BYTES / (2 * k) / 16 * 16;
    return np >= 64 ? 64 : np < 16 ? 16 : (int)np;
}

/* Weight row r of the row-concatenated shards: its type and bytes. */
static const uint8_t *weight_row(int64_t nshards, const uint8_t *const *w, const int32_t *types,
                                 const int64_t *rows, int64_t k, int64_t r, int *t) {
    int64_t s = 0;
    while (s + 1 < nshards && r >= rows[s]) r -= rows[s++];
    *t = types[s];
    return w[s] + r * gguf_row_bytes(*t, k);
}

/* Rows n0..n0+nc of W into the panel (nc <= np; the columns beyond nc zero), via a float32 row. */
static void pack_panel(int64_t nshards, const uint8_t *const *w, const int32_t *types, const int64_t *rows,
                       int64_t k, int64_t n0, int nc, int np, float *tmp, uint32_t *panel) {
    for (int n = 0; n < np; n++) {
        if (n >= nc) {
            for (int64_t p = 0; p < k / 2; p++) panel[p * np + n] = 0;
            continue;
        }
        int t;
        const uint8_t *row = weight_row(nshards, w, types, rows, k, n0 + n, &t);
        dequant_row(t, row, k, tmp);
        for (int64_t i = 0; i < k; i += 16) {
            /* 16 floats to 16 bf16 (nearest even) = 8 pairs, each a 32-bit unit of its own k-step. */
            uint32_t pairs[8];
            _mm256_storeu_si256((__m256i *)pairs, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(tmp + i)));
            for (int j = 0; j < 8; j++) panel[(i / 2 + j) * np + n] = pairs[j];
        }
    }
}

/* y[m0..m0+MR, n0..n0+nc) of x (bf16 rows, stride ldx) times the panel of NV*16 columns, over all k. */
INLINE void row_block(int MR, int NV, const uint16_t *x, int64_t ldx, const uint32_t *panel, int64_t k,
                      void *y, int64_t ldy, int y_bf16, int nc) {
    __m512 acc[12][4];
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k / 2; p++) {
        __m512bh b[4];
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) b[j] = (__m512bh)_mm512_loadu_si512(panel + p * (NV * 16) + 16 * j);
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++) {
            int32_t pair;
            memcpy(&pair, x + i * ldx + 2 * p, 4);
            __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
            for (int j = 0; j < NV; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NV; j++) {
            int left = nc - 16 * j;
            if (left <= 0) break;
            __mmask16 mask = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            if (y_bf16)
                _mm256_mask_storeu_epi16((uint16_t *)y + i * ldy + 16 * j, mask,
                                         (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
            else
                _mm512_mask_storeu_ps((float *)y + i * ldy + 16 * j, mask, acc[i][j]);
        }
}

/* Row blocks of MR rows (as many as fit the 32 registers with NV column vectors) over all M rows. */
#define ROW_BLOCKS(NV, MR)                                                                              \
    for (int64_t m0 = 0; m0 < M; m0 += MR) {                                                            \
        const uint16_t *xb = x + m0 * ldx;                                                              \
        void *yb = y_bf16 ? (void *)((uint16_t *)y + m0 * ldy + n0) : (void *)((float *)y + m0 * ldy + n0); \
        switch (M - m0 >= MR ? MR : (int)(M - m0)) {                                                    \
        case 1: row_block(1, NV, xb, ldx, panel, k, yb, ldy, y_bf16, nc); break; \
        case 2: row_block(2, NV, xb, ldx, panel, k, yb, ldy, y_bf16, nc); break; \
        case 3: row_block(3, NV, xb, ldx, panel, k, yb, ldy, y_bf16, nc); break; \
        case 4: row_block(4, NV, xb, ldx, panel, k, yb, ldy, y_bf16, nc); break; \
        case 5: row_block(5, NV, xb, ldx, panel, k, yb, ldy, y_bf16, nc); break; \
        case 6: row_block(6, NV, xb, ldx, panel, k, yb, ldy, y_bf16, nc); break; \
        case 7: row_block(7, NV, xb, ldx, panel, k, yb, ldy, y_bf16, nc); break; \
        case 8: row_block(8, NV, xb, ldx, panel, k, yb, ldy, y_bf16, nc); break; \
        case 9: row_block(9, NV, xb, ldx, panel, k, yb, ldy, y_bf16, nc); break; \
        case 10: row_block(10, NV, xb, ldx, panel, k, yb, ldy, y_bf16, nc); break; \
        case 11: row_block(11, NV, xb, ldx, panel, k, yb, ldy, y_bf16, nc); break; \
        default: row_block(MR, NV, xb, ldx, panel, k, yb, ldy, y_bf16, nc); break;                      \
        }                                                                                               \
    }
#endif

/* y[m, :] = x[m, :] @ W^T for m < M: W as gguf_matmul takes it (quantized or float shards), x bfloat16
 * rows of stride ldx, y rows of stride ldy (bfloat16 where y_bf16, else float32). Returns -1 for an
 * unknown type or a k that is not whole blocks, -3 where the build has no AVX512-BF16. */
int gguf_matmul_panels(int64_t nshards, const uint8_t *const *w, const int32_t *types, const int64_t *rows,
                       int64_t k, const uint16_t *x, int64_t ldx, int64_t M, void *y, int64_t ldy, int y_bf16) {
#ifdef HAVE_PANELS
    int64_t total = 0;
    for (int64_t s = 0; s < nshards; s++) {
        if (!gguf_row_bytes(types[s], k) || k % 32) return -1;
        total += rows[s];
    }
    const int np = panel_width(k);
#pragma omp parallel
    {
        float *tmp = malloc(k * sizeof(float));
        uint32_t *panel = aligned_alloc(64, (size_t)np * k * 2);
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < total; n0 += np) {
            int nc = total - n0 < np ? (int)(total - n0) : np;
            pack_panel(nshards, w, types, rows, k, n0, nc, np, tmp, panel);
            /* Sums of MR rows x NP columns in 24 of the 32 registers (the rest hold the panel's vectors
             * and the broadcast activation pair). */
            if (np == 64) { ROW_BLOCKS(4, 6) }
            else if (np == 48) { ROW_BLOCKS(3, 8) }
            else if (np == 32) { ROW_BLOCKS(2, 12) }
            else { ROW_BLOCKS(1, 12) }
        }
        free(tmp);
        free(panel);
    }
    return 0;
#else
    (void)nshards; (void)w; (void)types; (void)rows; (void)k; (void)x; (void)ldx; (void)M; (void)y;
    (void)ldy; (void)y_bf16;
    return -3;
#endif
}

/* Whether this build has the panel product (AVX512-BF16). */
int gguf_panels_available(void) {
#ifdef HAVE_PANELS
    return 1;
#else
    return 0;
#endif
}
