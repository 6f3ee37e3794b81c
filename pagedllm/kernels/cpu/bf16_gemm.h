/* The batch-invariant bfloat16 product (bf16_gemm.c), for its Python binding (layers/bf16_gemm.py) and
 * for the native model body (llama_decode.c), which runs every bfloat16 projection through it.
 */
#ifndef PAGEDLLM_KERNELS_BF16_GEMM_H
#define PAGEDLLM_KERNELS_BF16_GEMM_H
#include <stdint.h>

/* y [m, n] (row-major; float32 if float_out, else bfloat16) = x [m, k] (bfloat16, row stride x_stride)
 * W [n, k]^T (bfloat16, contiguous) (+ bias [n], bfloat16, or NULL), each output element computed the
 * same way at any m, row and thread count. Returns 0, -1 where this build has no AVX512-BF16 (check
 * bf16_gemm_supported) or a size is not positive, or -2 where a thread's packing buffer cannot be allocated. */
int bf16_gemm(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int64_t m, int64_t n,
              int64_t k, int float_out);
int bf16_gemm_supported(void);

#endif
