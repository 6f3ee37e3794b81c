/* The paged attention kernels' interface (attention_decode.c, attention_prefill.c), for their Python
 * bindings (attention/backends/cpu_decode.py; the structs mirrored in kernels/abi.py) and for the
 * native decode body (llama_decode.c), which calls the decode entries once per layer (or stores a
 * step's keys and runs the prompt entry, for a step given as segments).
 */
#ifndef PAGEDLLM_KERNELS_ATTENTION_H
#define PAGEDLLM_KERNELS_ATTENTION_H
#include <stdint.h>

/* The fixed per-thread buffers: query heads per kv head, and head size. */
#define MAX_GROUP 16
#define MAX_HEAD 256

/* What a decode call needs from the step (the same for every layer), and from the layer's head
 * layout (the same for every layer of that layout): built once by the caller, passed by pointer, so
 * a layer's call converts only its own tensors' addresses. */
typedef struct {
    const int32_t *tables;
    int64_t table_stride;
    const int64_t *q_rows, *table_rows, *seq_lens;
    int64_t num_reqs;
    const int64_t *slots; /* cache slot of each of the step's num_slots new tokens */
    int64_t num_slots;    /* 0: the keys were written already (a step with prompts writes first) */
} StepArgs;

typedef struct {
    int64_t num_heads, num_kv_heads, head_size, block_size;
    int64_t v_offset; /* elements from the key half of a layer's cache to its value half */
    float scale;
    int64_t window;
    float soft_cap;     /* logits soft cap (Gemma-2), 0: none */
    int64_t cache_type; /* F32, BF16, E4M3 or E5M2 (vec.h) */
} LayerArgs;

/* One layer's decode attention (float32 or bfloat16 activations): stores the step's new keys and
 * values (if s->num_slots), then attends each decode row's query. The cache is [2, num_blocks,
 * num_kv_heads, block_size, head] of l->cache_type; `kv_scales` its [k_scale, v_scale] (NULL: 1).
 * 0 on success. */
int decode_layer_f32(const void *q, int64_t q_stride, const void *key, int64_t key_stride, const void *value,
                     int64_t value_stride, void *cache, const float *kv_scales, void *out, int64_t out_stride,
                     const StepArgs *s, const LayerArgs *l);
int decode_layer_bf16(const void *q, int64_t q_stride, const void *key, int64_t key_stride, const void *value,
                      int64_t value_stride, void *cache, const float *kv_scales, void *out, int64_t out_stride,
                      const StepArgs *s, const LayerArgs *l);

/* Stores token i's key and value rows ([n, num_kv_heads, head_size] with row strides, of the
 * activations' type) at cache slot slots[i] of the key and value halves; cache type `kv` (vec.h's
 * enum), an fp8 one storing x / scale. 0 on success, -1 for a cache type of neither. */
int write_kv_bf16(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,
                  void *v_cache, const int64_t *slots, int64_t n, int64_t num_kv_heads, int64_t block_size,
                  int64_t head_size, int64_t kv, const float *kv_scales);

/* Causal attention of prompt segments (bfloat16, a bfloat16 cache; attention_prefill.c): segment i
 * (segs[4 i ..]) is the query rows [start, start + len) at positions cached.., attending to keys
 * 0..cached + len - 1 of block-table row table_row, read from the cache (stored first). -1 where this
 * build or the layout is not served (check prefill_supported first). */
int prefill_layer_bf16(const void *q, int64_t q_stride, void *cache, void *out, int64_t out_stride,
                       const int32_t *tables, int64_t table_stride, const int64_t *segs, int64_t num_segs,
                       const LayerArgs *l);

#endif
