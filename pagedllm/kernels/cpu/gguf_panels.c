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

/* The 16 x 16 transpose of 32-bit units: v[i] unit j becomes v[j] unit i. */
INLINE void transpose16(__m512i v[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* Each 128-bit lane now holds a 4 x 4 block transposed; the 128-bit shuffles move the blocks. */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        v[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        v[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* Elements dequantized per row per step of the panel's packing: 16 rows of them as float32 (16 KB)
 * stay in L1 while they are transposed. */
#define PACK_STEP 256

/* Rows n0..n0+nc of W into the panel (nc <= np; the columns beyond nc zero): per 16 rows and
 * PACK_STEP elements, each row dequantized to float32, 32 elements at a time rounded to 16 bf16 pairs
 * (one vector a row), and the 16 x 16 pairs transposed so that each k-step's 16 columns are one store. */
static void pack_panel(int64_t nshards, const uint8_t *const *w, const int32_t *types, const int64_t *rows,
                       int64_t k, int64_t n0, int nc, int np, float *tmp, uint32_t *panel) {
    for (int g = 0; g < np; g += 16) {
        for (int64_t e0 = 0; e0 < k; e0 += PACK_STEP) {
            int64_t len = k - e0 < PACK_STEP ? k - e0 : PACK_STEP;
            for (int r = 0; r < 16; r++) {
                if (g + r >= nc) {
                    memset(tmp + r * PACK_STEP, 0, len * sizeof(float));
                    continue;
                }
                int t;
                const uint8_t *row = weight_row(nshards, w, types, rows, k, n0 + g + r, &t);
                dequant_range(t, row, e0, e0 + len, tmp + r * PACK_STEP);
            }
            for (int64_t i = 0; i < len; i += 32) {
                __m512i v[16];
                for (int r = 0; r < 16; r++) {
                    const float *f = tmp + r * PACK_STEP + i;
                    v[r] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(f + 16), _mm512_loadu_ps(f));
                }
                transpose16(v);
                for (int q = 0; q < 16; q++) _mm512_storeu_si512(panel + ((e0 + i) / 2 + q) * np + g, v[q]);
            }
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
        float *tmp = malloc(16 * PACK_STEP * sizeof(float));
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
