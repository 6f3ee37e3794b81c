/* Paged causal attention of prompt segments for CPUs with AVX512-BF16, built into one library with
 * the decode kernel (attention_decode.c, whose LayerArgs it takes).
 *
 * Flash attention with bfloat16 dot products on both sides: the scores QK^T and the value sums PV
 * are `vdpbf16ps` micro-GEMMs (bfloat16 pairs multiplied exactly, summed in float), the
 * probabilities rounded to bfloat16 for PV as flash-attention kernels do on GPUs. torch's CPU
 * flash-attention kernel computes bfloat16 inputs in float32 at a fraction of the bfloat16 GEMM
 * rate, and a float PV product runs at half the rate of a bfloat16 one.
 *
 * First, per segment and kv head, its keys are read from the paged cache (the step's keys are
 * stored first, so a chunk with a cached prefix needs no gathered copy) and prepared once, KEY_BLOCK
 * at a time: the keys transposed into dimension pairs (one vector per pair of dimensions holds that
 * pair for 16 keys), the values into key pairs (one vector per pair of keys holds 16 dimensions of
 * both). Then the work items = (segment, kv head, tile of query rows): the tile's rows times the
 * group's query heads (up to TILE_M query vectors), each run of QK_ROWS of them taking the 16-key
 * chunks of each block it can see: scores in registers (a query pair broadcast against the chunks'
 * key pairs), the online softmax in base 2 (the scale and log2 e folded into one multiply),
 * probabilities to bfloat16 pairs, PV into the run's float sums. Only runs that miss some key of
 * their chunks compute masks.
 *
 * Batch invariance: a query row's result is the same sequence of operations whatever else is in the
 * step, its tile or its segment (a whole prompt, a chunk over a cached prefix, a decode row): key
 * blocks start at multiples of KEY_BLOCK of the key position, every value is per row, and a chunk a
 * row cannot see changes nothing for it (its probabilities are exact zeros against finite or zeroed
 * values, its maximum -FLT_MAX), so skipping it for some rows and not others gives the same bits.
 *
 * Layouts: q [tokens, num_heads, head] with row stride q_stride; out the same with out_stride; the
 * cache [2, num_blocks, num_kv_heads, block_size, head]; segment i (segs[4 i ..]) is the query rows
 * [start, start + len) at positions num_computed.., attending to keys 0..num_computed + len - 1 of
 * block-table row table_row (the last `window` ones, if window > 0), scores soft-capped if
 * soft_cap > 0.
 */
#include "attention.h"
#include "vec.h"
#include <stdlib.h>

#ifdef __AVX512BF16__
#define TILE_M 48
#define KEY_BLOCK 64
#define CHUNKS (KEY_BLOCK / 16)
#define QK_ROWS 4
#define LOG2E 1.44269504088896341f

/* Rows i and i + s of `r` (16 rows of 16 words, i's bit s clear) swap their off-diagonal s x s
 * blocks: after s = 8, 4, 2, 1 the rows hold the columns. */
#define SWAP_BLOCKS(r, s, LO, HI)                                                \
    for (int i = 0; i < 16; i++)                                                 \
        if (!(i & (s))) {                                                        \
            const __m512i x = r[i], y = r[i + (s)];                              \
            r[i] = _mm512_permutex2var_epi32(x, LO, y);                          \
            r[i + (s)] = _mm512_permutex2var_epi32(x, HI, y);                    \
        }

/* kt[p * KEY_BLOCK + j] = the p-th dimension pair of key j, for the n (<= 16) keys at `k` (rows of D
 * bf16; rows n..15 read as zero). */
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
        for (int p = 0; p < 16; p++) _mm512_storeu_si512(kt + (p0 + p) * KEY_BLOCK, r[p]);
    }
}

/* vp[j * D + d] = (value 2j, value 2j + 1) of dimension d, for j < 8: the n (<= 16) values at `v`
 * (rows of D bf16; rows n..15 read as zero: a slot past the sequence may hold NaN, and 0 * NaN is
 * NaN). */
INLINE void pair_values(const uint16_t *v, int64_t n, uint32_t *vp, const int64_t D) {
    static const int16_t masks[2][32] = {
        {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
         8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
        {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
         24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63},
    };
    const __m512i lo = _mm512_loadu_si512(masks[0]), hi = _mm512_loadu_si512(masks[1]);
    for (int64_t j = 0; j < 8; j++)
        for (int64_t d = 0; d < D; d += 32) {
            const __m512i a = 2 * j < n ? _mm512_loadu_si512(v + 2 * j * D + d) : _mm512_setzero_si512();
            const __m512i b = 2 * j + 1 < n ? _mm512_loadu_si512(v + (2 * j + 1) * D + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + j * D + d, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(vp + j * D + d + 16, _mm512_permutex2var_epi16(a, hi, b));
        }
}

/* 2^x for x <= 0 on every lane (scores minus their running maximum, in base 2): 2^round(x) times a
 * degree-5 polynomial of the rest (|f| <= 1/2, relative error < 3e-6, far below the bfloat16
 * rounding of the result). Inputs below -126 give 2^-126 (masked lanes are zeroed by the caller). */
INLINE __m512 exp2_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

typedef struct {
    const uint16_t *q, *k, *v;
    uint16_t *out;
    const int32_t *tables;
    const int64_t *segs;
    int64_t q_stride, out_stride, table_stride, num_kv_heads, group, block_size, window;
    float scale, soft_cap;
    /* The prepared key blocks: segment i's blocks for kv head h start at block
     * first_block[i] + h * blocks[i] of `prepared`, its first at key key_begin[i]. */
    uint32_t *prepared;
    const int64_t *first_block, *blocks, *key_begin;
} PrefillArgs;

/* 32-bit words of one prepared key block: its keys as dimension pairs, then its values as key pairs. */
#define BLOCK_WORDS(D) (KEY_BLOCK * (D))

/* Prepares key block b of segment `seg`'s kv head h: the keys it has (up to the segment's last
 * position; the rest read as zero) transposed (kt[p * KEY_BLOCK + j]: pair p of key j) and the values
 * paired (vp[j * D + d]: dimension d of keys 2j and 2j + 1). */
INLINE void prepare_block(const PrefillArgs *a, int64_t seg, int64_t h, int64_t b, const int64_t D) {
    const int64_t bs = a->block_size, k_end = a->segs[4 * seg + 2] + a->segs[4 * seg + 1];
    const int32_t *table = a->tables + a->segs[4 * seg + 3] * a->table_stride;
    const int64_t k0 = a->key_begin[seg] + b * KEY_BLOCK;
    uint32_t *kt = a->prepared + (a->first_block[seg] + h * a->blocks[seg] + b) * BLOCK_WORDS(D);
    uint32_t *vp = kt + KEY_BLOCK * D / 2;
    for (int64_t c = 0; c < CHUNKS; c++) {
        const int64_t key = k0 + 16 * c, n = k_end - key < 16 ? (k_end - key > 0 ? k_end - key : 0) : 16;
        if (n == 0) {
            for (int64_t p = 0; p < D / 2; p++) memset(kt + p * KEY_BLOCK + 16 * c, 0, 16 * sizeof(uint32_t));
            memset(vp + c * 8 * D, 0, 8 * D * sizeof(uint32_t));
            continue;
        }
        const int64_t base = (((int64_t)table[key / bs] * a->num_kv_heads + h) * bs + key % bs) * D;
        transpose_keys(a->k + base, n, kt + 16 * c, D);
        pair_values(a->v + base, n, vp + c * 8 * D, D);
    }
}

/* What a tile keeps per query vector: its query as dimension pairs, its position (-1: padding), and
 * its online softmax (running maximum in base 2, lanes of the running sum of its bfloat16
 * probabilities, float output sums). */
typedef struct {
    uint32_t qp[TILE_M + QK_ROWS][MAX_HEAD / 2];
    float o[TILE_M + QK_ROWS][MAX_HEAD];
    __m512 sum[TILE_M + QK_ROWS];
    float max[TILE_M + QK_ROWS];
    int32_t pos[TILE_M + QK_ROWS];
} TileState;

/* The scores of the QK_ROWS query vectors at `qp` against chunks [c0, c0 + nch) of the key block. */
INLINE void scores(const uint32_t (*qp)[MAX_HEAD / 2], const uint32_t *kt, int64_t c0, const int nch, int64_t pairs,
                   __m512 s[QK_ROWS][CHUNKS]) {
    for (int r = 0; r < QK_ROWS; r++)
        for (int c = 0; c < nch; c++) s[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; i++) {
        __m512bh k[CHUNKS];
        for (int c = 0; c < nch; c++) k[c] = (__m512bh)_mm512_loadu_si512(kt + i * KEY_BLOCK + (c0 + c) * 16);
        for (int r = 0; r < QK_ROWS; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int32_t)qp[r][i]);
            for (int c = 0; c < nch; c++) s[r][c] = _mm512_dpbf16_ps(s[r][c], k[c], b);
        }
    }
}

/* o[r] = o[r] * fix[r] + the probabilities pb[r] (npairs key pairs) times the value pairs vp, for
 * the QK_ROWS rows and dimensions [d0, d0 + 16 cw). */
INLINE void accumulate(float (*o)[MAX_HEAD], const float *fix, const uint32_t (*pb)[KEY_BLOCK / 2],
                       const uint32_t *vp, int64_t npairs, int64_t d0, const int cw, const int64_t D) {
    __m512 acc[QK_ROWS][4];
    for (int r = 0; r < QK_ROWS; r++)
        for (int c = 0; c < cw; c++) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(&o[r][d0 + 16 * c]), _mm512_set1_ps(fix[r]));
    for (int64_t j = 0; j < npairs; j++) {
        __m512bh x[4];
        for (int c = 0; c < cw; c++) x[c] = (__m512bh)_mm512_loadu_si512(vp + j * D + d0 + 16 * c);
        for (int r = 0; r < QK_ROWS; r++) {
            const __m512bh p = (__m512bh)_mm512_set1_epi32((int32_t)pb[r][j]);
            for (int c = 0; c < cw; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x[c], p);
        }
    }
    for (int r = 0; r < QK_ROWS; r++)
        for (int c = 0; c < cw; c++) _mm512_storeu_ps(&o[r][d0 + 16 * c], acc[r][c]);
}

/* Query vectors [m0, m0 + QK_ROWS) of the tile against chunks [c0, c0 + nch) of the key block at
 * key k0 (transposed keys kt, value pairs vp). */
INLINE void run_block(const PrefillArgs *a, TileState *t, int64_t m0, const uint32_t *kt, const uint32_t *vp,
                      int64_t k0, int64_t c0, const int nch, const int masked, const int64_t D) {
    __m512 s[QK_ROWS][CHUNKS];
    scores((const uint32_t (*)[MAX_HEAD / 2])&t->qp[m0], kt, c0, nch, D / 2, s);
    const float c = a->scale * LOG2E;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
    uint32_t pb[QK_ROWS][KEY_BLOCK / 2];
    float fix[QK_ROWS];
    for (int r = 0; r < QK_ROWS; r++) {
        const int32_t pos = t->pos[m0 + r];
        __mmask16 valid[CHUNKS];
        __m512 rowmax = _mm512_set1_ps(-FLT_MAX);
        for (int ch = 0; ch < nch; ch++) {
            valid[ch] = 0xffff;
            if (masked) {
                const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)(k0 + (c0 + ch) * 16)));
                valid[ch] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(pos));
                if (a->window > 0)
                    valid[ch] &= _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32(pos - (int32_t)a->window));
            }
            __m512 x;
            if (a->soft_cap > 0.0f) {
                vec y;
                const __m512 scaled = _mm512_mul_ps(s[r][ch], _mm512_set1_ps(a->scale));
                memcpy(&y, &scaled, sizeof y);
                y = soft_cap_vec(y, a->soft_cap);
                memcpy(&x, &y, sizeof x);
                x = _mm512_mul_ps(x, _mm512_set1_ps(LOG2E));
            } else {
                x = _mm512_mul_ps(s[r][ch], _mm512_set1_ps(c));
            }
            s[r][ch] = masked ? _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), valid[ch], x) : x;
            rowmax = _mm512_max_ps(rowmax, s[r][ch]);
        }
        const float old = t->max[m0 + r], block_max = _mm512_reduce_max_ps(rowmax);
        const float m = block_max > old ? block_max : old;
        fix[r] = m > old ? _mm512_cvtss_f32(exp2_nonpositive(_mm512_set1_ps(old - m))) : 1.0f;
        t->max[m0 + r] = m;
        __m512 sum = _mm512_mul_ps(t->sum[m0 + r], _mm512_set1_ps(fix[r]));
        for (int ch = 0; ch < nch; ch += 2) {
            const __m512 p0 = _mm512_maskz_mov_ps(valid[ch], exp2_nonpositive(_mm512_sub_ps(s[r][ch], _mm512_set1_ps(m))));
            const __m512 p1 = ch + 1 < nch ? _mm512_maskz_mov_ps(valid[ch + 1], exp2_nonpositive(_mm512_sub_ps(s[r][ch + 1], _mm512_set1_ps(m))))
                                           : _mm512_setzero_ps();
            const __m512bh pairs = _mm512_cvtne2ps_pbh(p1, p0);
            sum = _mm512_dpbf16_ps(sum, pairs, ones);
            _mm512_storeu_si512(pb[r] + ch * 8, (__m512i)pairs);
        }
        t->sum[m0 + r] = sum;
    }
    const int64_t npairs = nch * 8;
    const uint32_t *vpc = vp + c0 * 8 * D;
    float (*o)[MAX_HEAD] = &t->o[m0];
    if (D % 64 == 0)
        for (int64_t d0 = 0; d0 < D; d0 += 64) accumulate(o, fix, (const uint32_t (*)[KEY_BLOCK / 2])pb, vpc, npairs, d0, 4, D);
    else
        for (int64_t d0 = 0; d0 < D; d0 += 32) accumulate(o, fix, (const uint32_t (*)[KEY_BLOCK / 2])pb, vpc, npairs, d0, 2, D);
}

/* Query rows [row0, row1) of segment `seg` for kv head h; D: the head size, a compile-time constant
 * in the specialized copies. */
INLINE void prefill_task(const PrefillArgs *a, int64_t seg, int64_t h, int64_t row0, int64_t row1, const int64_t D) {
    const int64_t group = a->group, start = a->segs[4 * seg], computed = a->segs[4 * seg + 2];
    const int64_t m_count = (row1 - row0) * group;
    TileState t;
    /* Runs of QK_ROWS vectors: the last one padded with zero queries at no position. */
    const int64_t m_padded = (m_count + QK_ROWS - 1) / QK_ROWS * QK_ROWS;
    for (int64_t m = 0; m < m_padded; m++) {
        const int64_t row = row0 + m / group, head = h * group + m % group;
        if (m < m_count)
            memcpy(t.qp[m], a->q + (start + row) * a->q_stride + head * D, D * sizeof(uint16_t));
        else
            memset(t.qp[m], 0, D * sizeof(uint16_t));
        memset(t.o[m], 0, D * sizeof(float));
        t.sum[m] = _mm512_setzero_ps();
        t.max[m] = -FLT_MAX;
        t.pos[m] = m < m_count ? (int32_t)(computed + row) : -1;
    }
    /* Key blocks from the first row's window start to the last row's position. */
    const int64_t k_end = computed + row1, key_begin = a->key_begin[seg];
    int64_t k_begin = a->window > 0 ? computed + row0 - a->window + 1 : 0;
    k_begin = k_begin > key_begin ? k_begin / KEY_BLOCK * KEY_BLOCK : key_begin;
    const uint32_t *blocks = a->prepared + (a->first_block[seg] + h * a->blocks[seg]) * BLOCK_WORDS(D);
    for (int64_t k0 = k_begin; k0 < k_end; k0 += KEY_BLOCK) {
        const uint32_t *kt = blocks + (k0 - key_begin) / KEY_BLOCK * BLOCK_WORDS(D), *vp = kt + KEY_BLOCK * D / 2;
        for (int64_t m0 = 0; m0 < m_count; m0 += QK_ROWS) {
            const int64_t last = m0 + QK_ROWS <= m_count ? m0 + QK_ROWS - 1 : m_count - 1;
            if (t.pos[last] < k0) continue;
            /* This run's chunks: from its first row's window start to its last row's position. */
            int64_t lo = 0, hi = (t.pos[last] - k0) / 16 + 1;
            hi = hi < CHUNKS ? hi : CHUNKS;
            if (a->window > 0 && t.pos[m0] - a->window + 1 > k0) lo = (t.pos[m0] - a->window + 1 - k0) / 16;
            if (lo >= hi) continue;
            /* Masks only where some row misses some of these keys (the run's padding rows see none). */
            const int masked = last - m0 + 1 < QK_ROWS || k0 + 16 * hi - 1 > t.pos[m0] ||
                               (a->window > 0 && k0 + 16 * lo <= t.pos[last] - a->window);
#define RUN(N)                                                           \
    if (masked)                                                          \
        run_block(a, &t, m0, kt, vp, k0, lo, N, 1, D);                   \
    else                                                                 \
        run_block(a, &t, m0, kt, vp, k0, lo, N, 0, D);                   \
    break;
            switch (hi - lo) {
            case 1: RUN(1)
            case 2: RUN(2)
            case 3: RUN(3)
            default: RUN(4)
            }
#undef RUN
        }
    }
    for (int64_t m = 0; m < m_count; m++) {
        const int64_t row = row0 + m / group, head = h * group + m % group;
        const float total = _mm512_reduce_add_ps(t.sum[m]);
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        uint16_t *dst = a->out + (start + row) * a->out_stride + head * D;
        for (int64_t d = 0; d < D; d++) dst[d] = float_to_bf16(t.o[m][d] * inv);
    }
}

/* The work item `item` of `items` (last tiles first: they attend to the most keys, and dynamic
 * scheduling balances the rest): its segment, kv head and rows. */
INLINE void tile_of(const int64_t *segs, int64_t num_segs, int64_t kv_heads, int64_t rows_per_tile, int64_t items,
                    int64_t item, int64_t *seg, int64_t *h, int64_t *row0, int64_t *row1) {
    int64_t s = 0, rest = items - 1 - item;
    for (; s < num_segs; s++) {
        const int64_t tiles = (segs[4 * s + 1] + rows_per_tile - 1) / rows_per_tile;
        if (rest < tiles * kv_heads) break;
        rest -= tiles * kv_heads;
    }
    const int64_t len = segs[4 * s + 1];
    *seg = s;
    *h = rest % kv_heads;
    *row0 = rest / kv_heads * rows_per_tile;
    *row1 = *row0 + rows_per_tile < len ? *row0 + rows_per_tile : len;
}

/* Prompt attention of `num_segs` segments for one layer (bfloat16 only); -1 on shapes it cannot
 * serve (check prefill_supported first). */
int prefill_layer_bf16(const void *q, int64_t q_stride, void *cache, void *out, int64_t out_stride,
                       const int32_t *tables, int64_t table_stride, const int64_t *segs, int64_t num_segs,
                       const LayerArgs *l) {
    const int64_t D = l->head_size, group = l->num_heads / l->num_kv_heads, heads = l->num_kv_heads;
    if (D % 32 || D > MAX_HEAD || group > TILE_M || l->block_size % 16 || l->cache_type != BF16) return -1;
    if (num_segs <= 0) return 0;
    /* Per segment: its keys from the first one its first row's window reaches (a multiple of
     * KEY_BLOCK) to its last position, in KEY_BLOCK blocks per kv head, each prepared once. */
    int64_t *plan = malloc(3 * num_segs * sizeof(int64_t));
    if (!plan) return -1;
    int64_t *first_block = plan, *blocks = plan + num_segs, *key_begin = plan + 2 * num_segs, total = 0;
    for (int64_t s = 0; s < num_segs; s++) {
        const int64_t computed = segs[4 * s + 2], k_end = computed + segs[4 * s + 1];
        const int64_t reach = l->window > 0 ? computed - l->window + 1 : 0;
        key_begin[s] = reach > 0 ? reach / KEY_BLOCK * KEY_BLOCK : 0;
        blocks[s] = (k_end - key_begin[s] + KEY_BLOCK - 1) / KEY_BLOCK;
        first_block[s] = total;
        total += blocks[s] * heads;
    }
    uint32_t *prepared = aligned_alloc(64, (size_t)total * BLOCK_WORDS(D) * sizeof(uint32_t));
    if (!prepared) {
        free(plan);
        return -1;
    }
    const PrefillArgs a = {q, cache, (const uint16_t *)cache + l->v_offset, out, tables, segs, q_stride,
                           out_stride, table_stride, heads, group, l->block_size, l->window,
                           l->scale, l->soft_cap, prepared, first_block, blocks, key_begin};
    const int64_t rows_per_tile = TILE_M / group;
    int64_t items = 0;
    for (int64_t s = 0; s < num_segs; s++) items += heads * ((segs[4 * s + 1] + rows_per_tile - 1) / rows_per_tile);
#pragma omp parallel
    {
        /* Block i of the list: segment s's block (i - first_block[s]) % blocks[s] of kv head
         * (i - first_block[s]) / blocks[s]. */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < total; i++) {
            int64_t s = 0, hi = num_segs - 1;
            while (s < hi) {
                const int64_t mid = (s + hi + 1) / 2;
                if (first_block[mid] <= i)
                    s = mid;
                else
                    hi = mid - 1;
            }
            const int64_t j = i - first_block[s];
            prepare_block(&a, s, j / blocks[s], j % blocks[s], D);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            int64_t seg, h, row0, row1;
            tile_of(segs, num_segs, heads, rows_per_tile, items, item, &seg, &h, &row0, &row1);
            if (D == 64)
                prefill_task(&a, seg, h, row0, row1, 64);
            else if (D == 128)
                prefill_task(&a, seg, h, row0, row1, 128);
            else
                prefill_task(&a, seg, h, row0, row1, D);
        }
    }
    free(prepared);
    free(plan);
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
