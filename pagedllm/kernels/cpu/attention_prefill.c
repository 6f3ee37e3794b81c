/* Paged causal attention of prompt segments for CPUs with AVX512-BF16, built into one library with
 * the decode kernel (attention_decode.c, whose LayerArgs it takes).
 *
 * torch's CPU flash-attention kernel computes bfloat16 inputs in float32, far below what a bfloat16
 * GEMM reaches on the same cores (benchmarks/RESULTS.md, "Figures behind code choices"); here the
 * scores come from `vdpbf16ps` (bfloat16 pairs multiplied exactly, summed in float) and the value
 * sums from float FMAs. Keys and values are read straight from the paged cache (the step's keys are stored first),
 * so a chunk with a cached prefix needs no gathered copy either.
 *
 * Work item = (segment, kv head, tile of query rows): the tile's rows times the group's query heads
 * (TILE_M query vectors) go through the keys 16 at a time. Per 16 keys the keys are transposed into
 * dimension pairs (one vector per pair of dimensions holds that pair for all 16 keys), so a query
 * vector's 16 scores are D/2 `vdpbf16ps` with the query's pair broadcast; the values are converted to
 * float once for the tile. Softmax is online per 16 keys.
 *
 * Layouts: q [tokens, num_heads, head] with row stride q_stride; out the same with out_stride; the
 * cache [2, num_blocks, num_kv_heads, block_size, head]; segment i (segs[4 i ..]) is the query rows
 * [start, start + len) at positions num_computed.., attending to keys 0..num_computed + len - 1 of
 * block-table row table_row (the last `window` ones, if window > 0), scores soft-capped if
 * soft_cap > 0.
 */
#include "attention.h"
#include "vec.h"

#define MAX_CHUNKS (MAX_HEAD / LANES)

#ifdef __AVX512BF16__
#define TILE_M 48

/* Rows i and i + s of `r` (16 rows of 16 words, i's bit s clear) swap their off-diagonal s x s
 * blocks: after s = 8, 4, 2, 1 the rows hold the columns. */
#define SWAP_BLOCKS(r, s, LO, HI)                                                \
    for (int i = 0; i < 16; i++)                                                 \
        if (!(i & (s))) {                                                        \
            const __m512i x = r[i], y = r[i + (s)];                              \
            r[i] = _mm512_permutex2var_epi32(x, LO, y);                          \
            r[i + (s)] = _mm512_permutex2var_epi32(x, HI, y);                    \
        }

/* kt[p * 16 + j] = the p-th dimension pair of key j, for the n (<= 16) keys at `k` (rows of D bf16;
 * rows n..15 read as zero). */
INLINE void transpose_keys(const uint16_t *k, int64_t n, uint32_t *kt, const int64_t D) {
    static const int32_t masks[4][2][16] = {
        {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
         {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}},
        {{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
         {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}},
        {{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
         {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}},
        {{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
         {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}},
    };
    __m512i lo[4], hi[4];
    for (int s = 0; s < 4; s++) {
        lo[s] = _mm512_loadu_si512(masks[s][0]);
        hi[s] = _mm512_loadu_si512(masks[s][1]);
    }
    for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
        __m512i r[16];
        for (int j = 0; j < 16; j++)
            r[j] = j < n ? _mm512_loadu_si512(k + j * D + 2 * p0) : _mm512_setzero_si512();
        SWAP_BLOCKS(r, 8, lo[0], hi[0])
        SWAP_BLOCKS(r, 4, lo[1], hi[1])
        SWAP_BLOCKS(r, 2, lo[2], hi[2])
        SWAP_BLOCKS(r, 1, lo[3], hi[3])
        for (int p = 0; p < 16; p++) _mm512_storeu_si512(kt + (p0 + p) * 16, r[p]);
    }
}

typedef struct {
    const uint16_t *q, *k, *v;
    uint16_t *out;
    const int32_t *tables;
    const int64_t *segs;
    int64_t q_stride, out_stride, table_stride, num_kv_heads, group, block_size, window;
    float scale, soft_cap;
} PrefillArgs;

/* Query rows [row0, row1) of segment `seg` for kv head h. `nc`: head size in 16-lane chunks, a
 * compile-time constant in the specialized copies. QK_ROWS (16) query vectors go together: they
 * share each transposed key load, their score sums are independent chains (which `vdpbf16ps`'s
 * latency needs), and their softmax bookkeeping (row maxima, corrections, row sums) runs with one
 * row per vector lane. PV_ROWS of them share each value load. The buffers have QK_ROWS rows of
 * padding (zero queries, no valid key), so every block is full. */
#define QK_ROWS 16
INLINE void prefill_task(const PrefillArgs *a, int64_t seg, int64_t h, int64_t row0, int64_t row1,
                         const int64_t nc) {
    const int64_t D = nc * LANES, group = a->group, bs = a->block_size, pv_rows = nc <= 4 ? 4 : 2;
    const int64_t start = a->segs[4 * seg], computed = a->segs[4 * seg + 2];
    const int32_t *table = a->tables + a->segs[4 * seg + 3] * a->table_stride;
    const int64_t m_count = (row1 - row0) * group;
    uint32_t qp[TILE_M + QK_ROWS][MAX_HEAD / 2], kt[MAX_HEAD / 2 * 16];
    float o[TILE_M + QK_ROWS][MAX_HEAD], p[TILE_M + QK_ROWS][LANES], vf[LANES][MAX_HEAD];
    float run_max[TILE_M + QK_ROWS], run_sum[TILE_M + QK_ROWS], correction[TILE_M + QK_ROWS];
    int32_t pos[TILE_M + QK_ROWS];
    /* Only rows [0, m_padded) x D of qp and o are read; p is written before it is read. */
    const int64_t m_padded = (m_count + QK_ROWS - 1) / QK_ROWS * QK_ROWS;
    for (int64_t m = 0; m < TILE_M + QK_ROWS; m++) {
        const int64_t row = row0 + m / group, head = h * group + m % group;
        if (m < m_count)
            memcpy(qp[m], a->q + (start + row) * a->q_stride + head * D, D * sizeof(uint16_t));
        else if (m < m_padded)
            memset(qp[m], 0, D * sizeof(uint16_t));
        if (m < m_padded) memset(o[m], 0, D * sizeof(float));
        run_max[m] = -FLT_MAX;
        run_sum[m] = 0.0f;
        pos[m] = m < m_count ? (int32_t)(computed + row) : -1;
    }
    /* Keys [k_begin, k_end): up to the last row's position, from the first row's window start. */
    const int64_t k_end = computed + row1;
    int64_t k_begin = a->window > 0 ? computed + row0 - a->window + 1 : 0;
    k_begin = k_begin > 0 ? k_begin / LANES * LANES : 0;
    const int_vec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t k0 = k_begin; k0 < k_end; k0 += LANES) {
        const int64_t n = k_end - k0 < LANES ? k_end - k0 : LANES;
        const int64_t base = (((int64_t)table[k0 / bs] * a->num_kv_heads + h) * bs + k0 % bs) * D;
        transpose_keys(a->k + base, n, kt, D);
        for (int64_t t = 0; t < n; t++)
            for (int64_t c = 0; c < nc; c++) {
                const vec x = load_vec((const char *)(a->v + base + t * D + c * LANES), 1);
                memcpy(&vf[t][c * LANES], &x, sizeof x);
            }
        const int_vec key = lane + (int32_t)k0, exists = lane < (int32_t)n;
        for (int64_t m0 = 0; m0 < m_count; m0 += QK_ROWS) {
            const int64_t mb = m_count - m0 < QK_ROWS ? m_count - m0 : QK_ROWS;
            /* Rows go by position: skip a block whose rows all precede these keys or whose windows
             * all start after them. */
            if (k0 > pos[m0 + mb - 1] || (a->window > 0 && k0 + LANES <= pos[m0] - a->window + 1)) continue;
            __m512 s[QK_ROWS];
            for (int r = 0; r < QK_ROWS; r++) s[r] = _mm512_setzero_ps();
            for (int64_t i = 0; i < D / 2; i++) {
                const __m512bh k = (__m512bh)_mm512_loadu_si512(kt + i * 16);
                for (int r = 0; r < QK_ROWS; r++)
                    s[r] = _mm512_dpbf16_ps(s[r], k, (__m512bh)_mm512_set1_epi32((int32_t)qp[m0 + r][i]));
            }
            vec scores[QK_ROWS], w[QK_ROWS];
            int_vec valid[QK_ROWS];
            for (int r = 0; r < QK_ROWS; r++) {
                memcpy(&scores[r], &s[r], sizeof(vec));
                valid[r] = exists & (key <= pos[m0 + r]);
                if (a->window > 0) valid[r] &= key > pos[m0 + r] - (int32_t)a->window;
                scores[r] *= a->scale;
                if (a->soft_cap > 0.0f) scores[r] = soft_cap_vec(scores[r], a->soft_cap);
                scores[r] = select_vec(valid[r], scores[r], (vec){0} - FLT_MAX);
            }
            vec old_max, old_sum;
            memcpy(&old_max, run_max + m0, sizeof(vec));
            memcpy(&old_sum, run_sum + m0, sizeof(vec));
            const vec new_max = combine(old_max, reduce_lanes(scores, 1), 1);
            const vec fix = exp_nonpositive_vec(old_max - new_max);
            for (int r = 0; r < QK_ROWS; r++) {
                w[r] = select_vec(valid[r], exp_nonpositive_vec(scores[r] - new_max[r]), (vec){0});
                memcpy(p[m0 + r], &w[r], sizeof(vec));
            }
            const vec new_sum = old_sum * fix + reduce_lanes(w, 0);
            memcpy(run_max + m0, &new_max, sizeof(vec));
            memcpy(run_sum + m0, &new_sum, sizeof(vec));
            memcpy(correction + m0, &fix, sizeof(vec));
            /* Only the keys that exist: a slot past the sequence may hold NaN, and 0 * NaN is NaN. */
            for (int64_t r0 = 0; r0 < mb; r0 += pv_rows) {
                vec acc[4][MAX_CHUNKS];
                for (int64_t r = 0; r < pv_rows; r++)
                    for (int64_t c = 0; c < nc; c++) {
                        memcpy(&acc[r][c], &o[m0 + r0 + r][c * LANES], sizeof(vec));
                        acc[r][c] *= correction[m0 + r0 + r];
                    }
                for (int64_t t = 0; t < n; t++) {
                    vec x[MAX_CHUNKS];
                    for (int64_t c = 0; c < nc; c++) {
                        memcpy(&x[c], &vf[t][c * LANES], sizeof(vec));
                        __asm__("" : "+v"(x[c])); /* one load for all rows, not a memory operand per FMA */
                    }
                    for (int64_t r = 0; r < pv_rows; r++)
                        for (int64_t c = 0; c < nc; c++) acc[r][c] += p[m0 + r0 + r][t] * x[c];
                }
                for (int64_t r = 0; r < pv_rows; r++)
                    for (int64_t c = 0; c < nc; c++) memcpy(&o[m0 + r0 + r][c * LANES], &acc[r][c], sizeof(vec));
            }
        }
    }
    for (int64_t m = 0; m < m_count; m++) {
        const int64_t row = row0 + m / group, head = h * group + m % group;
        const float inv = run_sum[m] > 0.0f ? 1.0f / run_sum[m] : 0.0f;
        uint16_t *dst = a->out + (start + row) * a->out_stride + head * D;
        for (int64_t d = 0; d < D; d++) dst[d] = float_to_bf16(o[m][d] * inv);
    }
}

/* Prompt attention of `num_segs` segments for one layer (bfloat16 only); -1 on shapes it cannot
 * serve (check prefill_supported first). */
int prefill_layer_bf16(const void *q, int64_t q_stride, void *cache, void *out, int64_t out_stride,
                       const int32_t *tables, int64_t table_stride, const int64_t *segs, int64_t num_segs,
                       const LayerArgs *l) {
    const int64_t D = l->head_size, group = l->num_heads / l->num_kv_heads;
    if (D % 32 || D > MAX_HEAD || group > TILE_M || l->block_size % LANES || l->cache_type != BF16) return -1;
    const PrefillArgs a = {q, cache, (const uint16_t *)cache + l->v_offset, out, tables, segs, q_stride,
                           out_stride, table_stride, l->num_kv_heads, group, l->block_size, l->window,
                           l->scale, l->soft_cap};
    const int64_t rows_per_tile = TILE_M / group;
    int64_t items = 0;
    for (int64_t s = 0; s < num_segs; s++) items += l->num_kv_heads * ((segs[4 * s + 1] + rows_per_tile - 1) / rows_per_tile);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        /* Last tiles first: they attend to the most keys, and dynamic scheduling balances the rest. */
        int64_t seg = 0, rest = items - 1 - item, tiles = 0;
        for (; seg < num_segs; seg++) {
            tiles = (segs[4 * seg + 1] + rows_per_tile - 1) / rows_per_tile;
            if (rest < tiles * l->num_kv_heads) break;
            rest -= tiles * l->num_kv_heads;
        }
        const int64_t tile = rest / l->num_kv_heads, h = rest % l->num_kv_heads;
        const int64_t row0 = tile * rows_per_tile, len = segs[4 * seg + 1];
        const int64_t row1 = row0 + rows_per_tile < len ? row0 + rows_per_tile : len;
        if (D == 64)
            prefill_task(&a, seg, h, row0, row1, 4);
        else if (D == 128)
            prefill_task(&a, seg, h, row0, row1, 8);
        else
            prefill_task(&a, seg, h, row0, row1, D / LANES);
    }
    return 0;
}

int prefill_supported(void) { return 1; }
#else
int prefill_layer_bf16(const void *q, int64_t q_stride, void *cache, void *out, int64_t out_stride,
                       const int32_t *tables, int64_t table_stride, const int64_t *segs, int64_t num_segs,
                       const LayerArgs *l) {
    return -1;
}

int prefill_supported(void) { return 0; }
#endif
