/* The few-row product (skinny_gemm.c), for its Python binding (layers/skinny_gemm.py) and for the
 * native decode body (llama_decode.c), which runs the products of several tokens through it.
 */
#ifndef PAGEDLLM_KERNELS_SKINNY_GEMM_H
#define PAGEDLLM_KERNELS_SKINNY_GEMM_H
#include <stdint.h>

/* Rows of x a call takes: every input row keeps one accumulator in a register during the one pass
 * over a weight row; 8 of them and the weight chunk fit AVX2's 16 registers. */
#define MAX_ROWS 8

/* y [m, n] = x [m, k] (row stride x_stride) W [n, k]^T (+ bias [n], or NULL), all of one element
 * type (float32 or bfloat16; sums in float, each output rounded once); W, bias and y contiguous.
 * Returns 0, or -1 for shapes outside 1 <= m <= MAX_ROWS, -2 when out of memory. */
int skinny_gemm_f32(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int64_t m, int64_t n,
                    int64_t k);
int skinny_gemm_bf16(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int64_t m,
                     int64_t n, int64_t k);

#endif
