/* The tokens of a step of a Llama-family model from their token ids to their final hidden states, in
 * one call: float32 weights (AVX-512, or AVX2 + FMA matrix-vector products) or bfloat16 ones
 * (AVX512-BF16), quantized projections through their own kernels' matrix-vector entries. Two kinds of
 * step:
 * - decode rows (1 to MAX_ROWS: one sequence decoding, a few decoding together, or one request
 *   verifying its drafts), attended by the paged decode kernel of attention_decode.c (`decode_step_*`);
 * - any step at all of a bfloat16 model with dense weights (`model_step_bf16`): prompts, chunks,
 *   decode rows and verification rows together, each request a segment of the prompt-attention kernel
 *   (attention_prefill.c), the products bf16_gemm.c's. Every routine then computes a token the same way
 *   whatever else the step holds: products, norms, rotation and activation row by row, attention query
 *   by query over 16-key groups from the first key. A token's hidden states (and its keys and values
 *   in the cache) are bitwise the same in a prompt, a prefix-cache hit's short tail, a decode step
 *   alone or in any batch, and a verification step: the batch invariance seeded sampling, greedy
 *   streaming and speculative decoding rely on.
 *
 * A decode step of a few tokens reads every weight once: it is bound by memory bandwidth, and
 * through compiled graphs it also pays, per layer, the Python of a graph call, its buffer
 * allocations and the attention op's dispatch, with both threads waiting at each hand-off.
 * Here a layer is four products (one parallel loop each, every weight row read start to end so each
 * thread streams one contiguous range) and a few vector operations between them. The embedding row
 * and the final norm are here too: after the weights streamed through every cache, the dozen tensor
 * ops they took in Python cost cache misses every step. One float32 token's products are
 * matrix-vector products; several tokens' are skinny_gemm.c's few-row products (each weight row
 * loaded once for every token), the kernel the graphs call for those shapes, so a token's result is
 * the same here as there. bfloat16 products are bf16_gemm.c's at every row count.
 *
 * A quantized projection (GGUF blocks, AWQ/GPTQ int4, fp8) is not read here: its linear method
 * declares a `MatvecFn` of its own kernel library and a descriptor of its weight, called with the
 * input widened to float (once per token); the float result is rounded to the element type and the
 * bias added as the module does (its product rounds to the activations' type, then the bias is added
 * in that type).
 *
 * Numerics follow the model's modules: every tensor they would produce (normed input, projections,
 * rotated q/k, attention output, activation, residual sums) is rounded to the element type where
 * they round it; sums and statistics run in float.
 *
 * Built into the dense kernel library (with the attention kernels and the few-row products it
 * calls) by kernels/build.py; bindings: models/native/llama_decode.py.
 */
#include "attention.h"
#include "bf16_gemm.h"
#include "skinny_gemm.h"
#include "vec.h"

/* Which element types this build's dense products serve: float32 needs AVX-512 or AVX2 + FMA,
 * bfloat16 AVX512-BF16 (an AVX2-only CPU has no bfloat16 dense path: such models keep the graphs,
 * unless every projection is quantized). */
#ifdef __AVX512F__
#define HAVE_F32 1
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_F32 1
#define F32_AVX2 1
#else
#define HAVE_F32 0
#endif
#ifdef __AVX512BF16__
#define HAVE_BF16 1
#else
#define HAVE_BF16 0
#endif

/* One decoder layer's parameters (contiguous, of the model's element type) and its KV cache. The
 * projections' biases and the per-head q/k norms (Qwen3) are NULL where the model has none. A
 * projection (qkv, o, gate_up, down in that order) with a non-NULL `fns` entry is computed by it
 * with `descs`, and its weight pointer is unused. */
typedef struct {
    const void *input_norm, *qkv, *o, *post_norm, *gate_up, *down;
    void *kv_cache;
    const void *qkv_bias, *o_bias, *gate_up_bias, *down_bias, *q_norm, *k_norm;
    MatvecFn fns[4];
    const void *descs[4];
} LlamaLayer;

/* The model: its shapes, the one epsilon of all its norms, its token embedding [vocab, hidden] (NULL:
 * the caller writes the token's row into `out` before the call, for an embedding kept quantized),
 * final norm and decoder layers. */
typedef struct {
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_size, num_layers, vocab;
    float eps;
    const void *embedding, *final_norm;
    const LlamaLayer *layers;
} LlamaModel;

EXPORT_SIZE(LlamaLayer)
EXPORT_SIZE(LlamaModel)

/* Whether this build has the dense products of bfloat16 (bf16 != 0) or float32 weights. */
int native_decode_supported(int bf16) { return bf16 ? HAVE_BF16 : HAVE_F32; }

/* x rounded to the element type (bfloat16 where bf16 != 0, else float32). */
INLINE float rnd(float x, int bf16) { return bf16 ? bf16_to_float(float_to_bf16(x)) : x; }

#ifdef __AVX512F__
/* acc + the products of the 16 floats at `w` and `x` (the first `n` of them). */
INLINE __m512 dot_f32(__m512 acc, const float *w, const float *x, int64_t n) {
    if (n >= 16) return _mm512_fmadd_ps(_mm512_loadu_ps(w), _mm512_loadu_ps(x), acc);
    const __mmask16 m = (__mmask16)((1u << n) - 1);
    return _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w), _mm512_maskz_loadu_ps(m, x), acc);
}
#endif

#ifdef F32_AVX2
/* sum_i w_i x_i of k floats: four accumulators (the FMAs do not wait on each other), a scalar tail. */
INLINE float row_dot_avx2(const float *w, const float *x, int64_t k) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t c = 0;
    for (; c + 32 <= k; c += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c), _mm256_loadu_ps(x + c), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c + 8), _mm256_loadu_ps(x + c + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c + 16), _mm256_loadu_ps(x + c + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c + 24), _mm256_loadu_ps(x + c + 24), a3);
    }
    for (; c + 8 <= k; c += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c), _mm256_loadu_ps(x + c), a0);
    float tail = 0.0f;
    for (; c < k; c++) tail += w[c] * x[c];
    return hsum8((float8)_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) + tail;
}

/* y = W x (+ bias) for float32 weights, rounded as a linear layer rounds (float32: not at all): each
 * thread streams one contiguous range of rows, each row read start to end. */
INLINE void matvec(const void *W, const void *bias, const void *x, void *y, int64_t n, int64_t k, const int bf16) {
    (void)bf16; /* float32 only (native_decode_supported(1) is 0 in this build) */
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const float v = row_dot_avx2((const float *)W + r * k, x, k);
        ((float *)y)[r] = bias ? v + ((const float *)bias)[r] : v;
    }
}
#elif HAVE_F32
/* y = W x (+ bias, if not NULL) for float32 weights: W [n, k] row-major. Rows go 16 to a work item,
 * each row read start to end (the hardware prefetcher follows one stream per thread), two accumulators
 * per row; the 16 rows' lane sums come out of one transpose-sum. */
INLINE void matvec(const void *W, const void *bias, const void *x, void *y, int64_t n, int64_t k, const int bf16) {
    (void)bf16; /* float32 only: bfloat16 products are bf16_gemm's */
    const int64_t tiles = (n + LANES - 1) / LANES, step = 16;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t rows = n - t * LANES < LANES ? n - t * LANES : LANES;
        vec acc[LANES];
        for (int64_t r = 0; r < LANES; r++) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0;
            for (int64_t c = 0; r < rows && c < k; c += 2 * step) {
                const float *row = (const float *)W + (t * LANES + r) * k, *xs = x;
                a0 = dot_f32(a0, row + c, xs + c, k - c);
                if (c + step < k) a1 = dot_f32(a1, row + c + step, xs + c + step, k - c - step);
            }
            const __m512 s = _mm512_add_ps(a0, a1);
            memcpy(&acc[r], &s, sizeof s);
        }
        const vec sums = reduce_lanes(acc, 0);
        for (int64_t r = 0; r < rows; r++)
            store_elem(y, t * LANES + r, bias ? sums[r] + load_elem(bias, t * LANES + r, 0) : sums[r], 0);
    }
}
#endif

/* x = RMSNorm(v) * w (v: n floats holding values of the element type), rounded as the module does:
 * the normalized value to the element type, then its product with the weight. */
INLINE void rms_norm(const float *v, const void *w, void *x, int64_t n, float eps, const int bf16) {
    float squares = 0.0f;
    for (int64_t i = 0; i < n; i++) squares += v[i] * v[i];
    const float inv = 1.0f / sqrtf(squares / (float)n + eps);
    for (int64_t i = 0; i < n; i++) store_elem(x, i, rnd(v[i] * inv, bf16) * load_elem(w, i, bf16), bf16);
}

/* residual += h (if add; the residual stream is of the element type), then x = RMSNorm(residual) * w. */
INLINE void add_rms_norm(float *residual, const void *h, const void *w, void *x, int64_t n, float eps, int add,
                         const int bf16) {
    if (add)
        for (int64_t i = 0; i < n; i++) residual[i] = rnd(residual[i] + load_elem(h, i, bf16), bf16);
    rms_norm(residual, w, x, n, eps, bf16);
}

/* RMSNorm of each of the `heads` heads of size d (<= MAX_HEAD) at x, in place, weight w [d]. */
INLINE void head_norms(char *x, int64_t heads, int64_t d, const void *w, float eps, const int bf16) {
    float v[MAX_HEAD];
    for (int64_t h = 0; h < heads; h++) {
        char *head = x + h * d * (bf16 ? 2 : 4);
        for (int64_t i = 0; i < d; i++) v[i] = load_elem(head, i, bf16);
        rms_norm(v, w, head, d, eps, bf16);
    }
}

/* Neox-style rotation of `heads` heads of size d at x by the position's cos/sin row (float, cos
 * then sin, d / 2 each; cast to the element type first, as the module casts its table). */
INLINE void rotate(void *x, int64_t heads, int64_t d, const float *cos_sin, const int bf16) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        for (int64_t i = h * d; i < h * d + half; i++) {
            const float c = rnd(cos_sin[i - h * d], bf16), s = rnd(cos_sin[half + i - h * d], bf16);
            const float x1 = load_elem(x, i, bf16), x2 = load_elem(x, i + half, bf16);
            store_elem(x, i, rnd(x1 * c, bf16) - rnd(x2 * s, bf16), bf16);
            store_elem(x, i + half, rnd(x2 * c, bf16) + rnd(x1 * s, bf16), bf16);
        }
    }
}

/* gate_up [2 * n] -> out [n]: silu(gate) * up, silu's result rounded to the element type first.
 * 16 at a time: libm's scalar expf was a visible part of a layer. The sigmoid takes e^-|g| (<= 1, the
 * kernel's vector exponential) as 1 / (1 + e) for g >= 0 and e / (1 + e) below. */
INLINE void silu_and_mul(const void *gate_up, void *out, int64_t n, const int bf16) {
    for (int64_t i = 0; i < n; i += LANES) {
        const int64_t m = n - i < LANES ? n - i : LANES;
        vec g = {0};
        for (int64_t j = 0; j < m; j++) g[j] = load_elem(gate_up, i + j, bf16);
        const vec e = exp_nonpositive_vec(select_vec(g < 0.0f, g, -g));
        const vec silu = g * select_vec(g < 0.0f, e, (vec){0} + 1.0f) / (1.0f + e);
        for (int64_t j = 0; j < m; j++) store_elem(out, i + j, rnd(silu[j], bf16) * load_elem(gate_up, n + i + j, bf16), bf16);
    }
}

/* Projection p (0 qkv, 1 o, 2 gate_up, 3 down) of `layer` for `rows` tokens: y [rows, n] = x [rows, k]
 * W^T (+ bias). A quantized one runs its entry per token on the token's x widened to float (`xf`, k
 * floats) into `yf` (n floats), its result rounded to the element type and the bias added in that
 * type, as the module's product and bias add round. */
INLINE int project(const LlamaLayer *layer, int p, const void *W, const void *bias, const void *x, void *y,
                   int64_t rows, int64_t n, int64_t k, float *xf, float *yf, const int bf16) {
    const int64_t elem = bf16 ? 2 : 4;
    if (!layer->fns[p]) {
        if (bf16) return bf16_gemm(x, k, W, bias, y, rows, n, k, 0) ? -3 : 0;
#if HAVE_F32
        if (rows == 1) {
            matvec(W, bias, x, y, n, k, 0);
            return 0;
        }
        return skinny_gemm_f32(x, k, W, bias, y, rows, n, k);
#endif
        return -3;
    }
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * k * elem;
        char *yr = (char *)y + r * n * elem;
        const float *in = (const float *)xr;
        if (bf16) {
            for (int64_t i = 0; i < k; i++) xf[i] = load_elem(xr, i, 1);
            in = xf;
        }
        float *out = bf16 ? yf : (float *)yr;
        if (layer->fns[p](layer->descs[p], in, out)) return -6;
        for (int64_t i = 0; i < n; i++) {
            const float v = rnd(out[i], bf16);
            store_elem(yr, i, bias ? rnd(v + load_elem(bias, i, bf16), bf16) : v, bf16);
        }
    }
    return 0;
}

/* A whole step as segments of the prompt-attention kernel (`model_step_bf16`): the block tables (int32,
 * rows of table_stride), per request (segs[4 i ..]) its first row in the step, its rows, its tokens
 * cached before them and its block-table row, and the cache slot of each of the step's tokens. */
typedef struct {
    const int32_t *tables;
    int64_t table_stride;
    const int64_t *segs;
    int64_t num_segs;
    const int64_t *slots;
    int64_t num_slots;
} SegmentArgs;

EXPORT_SIZE(SegmentArgs)

/* One layer's attention of a step given as segments: the step's keys and values (parts of each token's
 * fused qkv row) stored first, then every segment's queries over its keys, as a prompt's are. */
static int attend_segments(const char *qkv, int64_t qkv_size, int64_t q_size, int64_t kv_size, void *cache,
                           void *out, int64_t out_stride, const SegmentArgs *s, const LayerArgs *l) {
    if (l->cache_type != BF16) return -1;
    const int status = write_kv_bf16(qkv + q_size * 2, qkv_size, qkv + (q_size + kv_size) * 2, qkv_size, cache,
                                     (char *)cache + l->v_offset * 2, s->slots, s->num_slots, l->num_kv_heads,
                                     l->block_size, l->head_size, BF16, NULL);
    return status ? status
                  : prefill_layer_bf16(qkv, qkv_size, cache, out, out_stride, s->tables, s->table_stride, s->segs,
                                       s->num_segs, l);
}

/* Steps of more than MAX_ROWS tokens (segment steps only) split their per-row loops across threads. */
#define PARALLEL_ROWS _Pragma("omp parallel for if (rows > MAX_ROWS)")

INLINE int decode_step(const LlamaModel *m, const int64_t *tokens, const int64_t *positions, int64_t rows,
                       const float *cos_sin, int64_t rotary_rows, void *out, float *floats, void *scratch,
                       const StepArgs *step, const SegmentArgs *segs, const LayerArgs *attn, const int bf16) {
    if (rows < 1 || (!segs && rows > MAX_ROWS)) return -7;
    for (int64_t r = 0; r < rows; r++) {
        if (tokens[r] < 0 || tokens[r] >= m->vocab) return -4;
        if (positions[r] < 0 || positions[r] >= rotary_rows) return -5;
    }
    const int64_t elem = bf16 ? 2 : 4, H = m->hidden, I = m->intermediate, D = m->head_size;
    const int64_t q_size = m->num_heads * D, kv_size = m->num_kv_heads * D, qkv_size = q_size + 2 * kv_size;
    char *h = scratch, *x = h + rows * H * elem, *qkv = x + rows * H * elem, *attn_out = qkv + rows * qkv_size * elem;
    char *gate_up = attn_out + rows * q_size * elem, *act = gate_up + rows * 2 * I * elem;
    /* floats: the residual streams [rows, H], a quantized projection's float input (at most the widest
     * of H, q and I) and output, one token at a time. */
    const int64_t widest_in = I > H ? (I > q_size ? I : q_size) : (H > q_size ? H : q_size);
    float *residual = floats, *xf = residual + rows * H, *yf = xf + widest_in;
    for (int64_t r = 0; r < rows; r++) {
        const char *row = m->embedding ? (const char *)m->embedding + tokens[r] * H * elem : (const char *)out + r * H * elem;
        memcpy(h + r * H * elem, row, (size_t)(H * elem));
    }
    for (int64_t i = 0; i < rows * H; i++) residual[i] = load_elem(h, i, bf16);
    for (int64_t l = 0; l < m->num_layers; l++) {
        const LlamaLayer *layer = m->layers + l;
        PARALLEL_ROWS
        for (int64_t r = 0; r < rows; r++)
            add_rms_norm(residual + r * H, h + r * H * elem, layer->input_norm, x + r * H * elem, H, m->eps, l > 0, bf16);
        int status = project(layer, 0, layer->qkv, layer->qkv_bias, x, qkv, rows, qkv_size, H, xf, yf, bf16);
        if (status) return status;
        PARALLEL_ROWS
        for (int64_t r = 0; r < rows; r++) {
            char *row = qkv + r * qkv_size * elem;
            if (layer->q_norm) {
                head_norms(row, m->num_heads, D, layer->q_norm, m->eps, bf16);
                head_norms(row + q_size * elem, m->num_kv_heads, D, layer->k_norm, m->eps, bf16);
            }
            rotate(row, m->num_heads + m->num_kv_heads, D, cos_sin + positions[r] * D, bf16);
        }
        /* q, k and v are the three parts of each token's fused qkv row. The caches hold the weights'
         * type (llama_decode.py binds no fp8 cache, whose per-layer scales this table lacks). */
        if (segs)
            status = attend_segments(qkv, qkv_size, q_size, kv_size, layer->kv_cache, attn_out, q_size, segs, attn);
        else
            status = (bf16 ? decode_layer_bf16 : decode_layer_f32)(qkv, qkv_size, qkv + q_size * elem, qkv_size,
                                                                   qkv + (q_size + kv_size) * elem, qkv_size,
                                                                   layer->kv_cache, NULL, attn_out, q_size, step,
                                                                   attn);
        if (status) return status;
        if ((status = project(layer, 1, layer->o, layer->o_bias, attn_out, h, rows, H, q_size, xf, yf, bf16)))
            return status;
        PARALLEL_ROWS
        for (int64_t r = 0; r < rows; r++)
            add_rms_norm(residual + r * H, h + r * H * elem, layer->post_norm, x + r * H * elem, H, m->eps, 1, bf16);
        if ((status = project(layer, 2, layer->gate_up, layer->gate_up_bias, x, gate_up, rows, 2 * I, H, xf, yf, bf16)))
            return status;
        PARALLEL_ROWS
        for (int64_t r = 0; r < rows; r++) silu_and_mul(gate_up + r * 2 * I * elem, act + r * I * elem, I, bf16);
        if ((status = project(layer, 3, layer->down, layer->down_bias, act, h, rows, H, I, xf, yf, bf16))) return status;
    }
    PARALLEL_ROWS
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm(residual + r * H, h + r * H * elem, m->final_norm, (char *)out + r * H * elem, H, m->eps, 1, bf16);
    return 0;
}

/* The final hidden states of a step's `rows` decode tokens (1 to MAX_ROWS, the attention step's
 * decode rows in order). In: their token ids and positions (int64 [rows]), the rotary table (float
 * [rotary_rows, head_size]: each row cos then sin, head_size / 2 each). Out: `out` ([rows, hidden] of
 * the element type; in: the tokens' embedding rows where the model's embedding is NULL). `floats`
 * (float [rows * hidden + max(hidden, q, intermediate) + max(hidden, q + 2 kv, 2 intermediate)]) holds
 * the residual streams and a quantized projection's float input and output; `scratch` rows * (2 *
 * hidden + (q + 2 kv) + q + 3 * intermediate) elements. The step (its decode rows, their new keys'
 * slots) and the attention layout are attention.h's. Returns 0; -4 for a token id outside the
 * vocabulary, -5 for a position outside the rotary table, -7 for a row count outside 1..MAX_ROWS, -3
 * for a dense projection this build has no product for (check native_decode_supported first), -6
 * where a quantized projection's entry failed; other non-zero values where the attention shapes are
 * not supported or memory ran out. */
#define EXPORT_STEP(NAME, BF16)                                                                               \
    int NAME(const LlamaModel *m, const int64_t *tokens, const int64_t *positions, int64_t rows,              \
             const float *cos_sin, int64_t rotary_rows, void *out, float *floats, void *scratch,              \
             const StepArgs *step, const LayerArgs *attn) {                                                   \
        return decode_step(m, tokens, positions, rows, cos_sin, rotary_rows, out, floats, scratch, step,     \
                           NULL, attn, BF16);                                                                 \
    }

EXPORT_STEP(decode_step_f32, 0)
EXPORT_STEP(decode_step_bf16, 1)

/* A whole step of a bfloat16 model whose projections are all dense (no `fns`), `rows` tokens (any
 * number: scratch and floats sized for them as above), the attention of every request a segment of
 * the prompt-attention kernel (its layout must serve it: prefill_layer_bf16's shapes, a bfloat16
 * cache). Same arguments and statuses as decode_step_*, the decode rows replaced by `segs`; -1 where
 * this build has no AVX512-BF16 or the attention shapes are not served. */
int model_step_bf16(const LlamaModel *m, const int64_t *tokens, const int64_t *positions, int64_t rows,
                    const float *cos_sin, int64_t rotary_rows, void *out, float *floats, void *scratch,
                    const SegmentArgs *segs, const LayerArgs *attn) {
    if (!HAVE_BF16) return -1;
    return decode_step(m, tokens, positions, rows, cos_sin, rotary_rows, out, floats, scratch, NULL, segs, attn, 1);
}
