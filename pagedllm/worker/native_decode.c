/* One decode token through every decoder layer of a Llama-family model, in one call: bfloat16
 * weights, AVX512-BF16 matrix-vector products, the paged attention kernel of cpu_decode.c.
 *
 * A single-sequence decode step reads every weight once for one token: it is bound by memory
 * bandwidth, and through compiled graphs it also pays, per layer, the Python of a graph call, its
 * buffer allocations and the attention op's dispatch, with both threads waiting at each hand-off.
 * Here a layer is four matrix-vector products (one parallel loop each, every row read start to end
 * so each thread streams one contiguous range) and a few vector operations between them.
 *
 * Numerics follow the model's bfloat16 modules: every tensor the modules would produce (normed
 * input, projections, rotated q/k, attention output, activation, residual sums) is rounded to
 * bfloat16 where they round it; sums and statistics run in float.
 *
 * Built by native_decode.py with the flags of cpu_decode.py; loaded with ctypes.
 */
#include "../attention/backends/cpu_decode.c"

#ifdef __AVX512BF16__
#define HAVE_NATIVE_DECODE 1
#else
#define HAVE_NATIVE_DECODE 0
#endif

/* One decoder layer's parameters (bfloat16, contiguous) and its KV cache. */
typedef struct {
    const uint16_t *input_norm, *qkv, *o, *post_norm, *gate_up, *down;
    void *kv_cache;
} LlamaLayer;

typedef struct {
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_size, num_layers;
    float eps;
} LlamaShape;

/* Whether this build has the decode path (an AVX512-BF16 CPU). */
int native_decode_supported(void) { return HAVE_NATIVE_DECODE; }

INLINE float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

#if HAVE_NATIVE_DECODE
/* acc + the pairwise products of the 32 bfloat16 at `w` and `x` (the first `n` of them). */
INLINE __m512 dot_pairs(__m512 acc, const uint16_t *w, const uint16_t *x, int64_t n) {
    if (n >= 32)
        return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), (__m512bh)_mm512_loadu_si512(x));
    const __mmask32 m = (__mmask32)((1ull << n) - 1);
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, w), (__m512bh)_mm512_maskz_loadu_epi16(m, x));
}

/* y = bf16(W x): W [n, k] row-major. Rows go 16 to a work item, each row read start to end (the
 * hardware prefetcher follows one stream per thread), two accumulators per row; the 16 rows' lane
 * sums come out of one transpose-sum. */
static void matvec(const uint16_t *W, const uint16_t *x, uint16_t *y, int64_t n, int64_t k) {
    const int64_t tiles = (n + LANES - 1) / LANES;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t rows = n - t * LANES < LANES ? n - t * LANES : LANES;
        vec acc[LANES];
        for (int64_t r = 0; r < LANES; r++) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0;
            const uint16_t *row = W + (t * LANES + r) * k;
            for (int64_t c = 0; r < rows && c < k; c += 64) {
                a0 = dot_pairs(a0, row + c, x + c, k - c);
                if (c + 32 < k) a1 = dot_pairs(a1, row + c + 32, x + c + 32, k - c - 32);
            }
            const __m512 s = _mm512_add_ps(a0, a1);
            memcpy(&acc[r], &s, sizeof s);
        }
        const vec sums = sum_lanes16(acc);
        for (int64_t r = 0; r < rows; r++) y[t * LANES + r] = float_to_bf16(sums[r]);
    }
}
#endif

/* residual += h (if add; the residual stream is bfloat16), then x = RMSNorm(residual) * w, rounded
 * as the module does: the normalized value to bfloat16, then its product with the weight. */
static void add_rms_norm(float *residual, const uint16_t *h, const uint16_t *w, uint16_t *x, int64_t n, float eps,
                         int add) {
    float squares = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        if (add) residual[i] = round_bf16(residual[i] + bf16_to_float(h[i]));
        squares += residual[i] * residual[i];
    }
    const float inv = 1.0f / sqrtf(squares / (float)n + eps);
    for (int64_t i = 0; i < n; i++) x[i] = float_to_bf16(round_bf16(residual[i] * inv) * bf16_to_float(w[i]));
}

/* Neox-style rotation of `heads` heads of size d at x by the position's cos/sin row (float, cos
 * then sin, d / 2 each; cast to bfloat16 first, as the module casts its table). */
static void rotate(uint16_t *x, int64_t heads, int64_t d, const float *cos_sin) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        uint16_t *p = x + h * d;
        for (int64_t i = 0; i < half; i++) {
            const float c = round_bf16(cos_sin[i]), s = round_bf16(cos_sin[half + i]);
            const float x1 = bf16_to_float(p[i]), x2 = bf16_to_float(p[half + i]);
            p[i] = float_to_bf16(round_bf16(x1 * c) - round_bf16(x2 * s));
            p[half + i] = float_to_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
        }
    }
}

/* gate_up [2 * n] -> out [n]: silu(gate) * up, silu's result rounded to bfloat16 first. */
static void silu_and_mul(const uint16_t *gate_up, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float g = bf16_to_float(gate_up[i]);
        out[i] = float_to_bf16(round_bf16(g / (1.0f + expf(-g))) * bf16_to_float(gate_up[n + i]));
    }
}

/* The decoder layers for one token. In: `h` the token's embedding (bfloat16 [hidden]). Out: `h` the
 * last layer's output and `residual` (float holding bfloat16 values) the residual stream before
 * it, for the final norm. `scratch` holds hidden + (q + 2 kv) + q + 3 * intermediate bfloat16.
 * `cos_sin` is the token position's row of the rotary table. The step (one decode request, its
 * new key's slot) and the attention layout are cpu_decode.c's. Returns 0, or non-zero where the
 * shapes are not supported (check native_decode_supported first). */
int decode_layers_bf16(const LlamaShape *shape, const LlamaLayer *layers, uint16_t *h, float *residual,
                       uint16_t *scratch, const float *cos_sin, const StepArgs *step, const LayerArgs *attn) {
#if HAVE_NATIVE_DECODE
    const int64_t H = shape->hidden, I = shape->intermediate, D = shape->head_size;
    const int64_t q_size = shape->num_heads * D, kv_size = shape->num_kv_heads * D, qkv_size = q_size + 2 * kv_size;
    uint16_t *x = scratch, *qkv = x + H, *out = qkv + qkv_size, *gate_up = out + q_size, *act = gate_up + 2 * I;
    for (int64_t l = 0; l < shape->num_layers; l++) {
        const LlamaLayer *layer = layers + l;
        add_rms_norm(residual, h, layer->input_norm, x, H, shape->eps, l > 0);
        matvec(layer->qkv, x, qkv, qkv_size, H);
        rotate(qkv, shape->num_heads + shape->num_kv_heads, D, cos_sin);
        char *k_cache = layer->kv_cache, *v_cache = (char *)layer->kv_cache + attn->v_offset * 2;
        write_kv((const char *)(qkv + q_size), kv_size, (const char *)(qkv + q_size + kv_size), kv_size, k_cache, v_cache,
                 step->slots, step->num_slots, attn->num_kv_heads, attn->block_size, D, 2);
        const DecodeArgs a = {(const char *)qkv, k_cache,          v_cache,           (char *)out,
                              step->tables,      step->q_rows,     step->table_rows,  step->seq_lens,
                              qkv_size,          q_size,           step->table_stride, attn->num_kv_heads,
                              attn->num_heads / attn->num_kv_heads, attn->block_size, attn->window, attn->scale};
        const int status = paged_decode(&a, step->num_reqs, D, 1);
        if (status) return status;
        matvec(layer->o, out, h, H, q_size);
        add_rms_norm(residual, h, layer->post_norm, x, H, shape->eps, 1);
        matvec(layer->gate_up, x, gate_up, 2 * I, H);
        silu_and_mul(gate_up, act, I);
        matvec(layer->down, act, h, H, I);
    }
    return 0;
#else
    (void)shape, (void)layers, (void)h, (void)residual, (void)scratch, (void)cos_sin, (void)step, (void)attn;
    return -3;
#endif
}
