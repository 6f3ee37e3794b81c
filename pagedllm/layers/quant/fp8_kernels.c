/* Rows of an fp8 weight widened to float32 for the batched product (fp8.py): out[r][i] =
 * table[q[r][i]] * scale[r], where `table` holds the float value of each of the 256 fp8 bit patterns
 * (computed by torch, so this file knows no fp8 format). torch's own fp8 -> float32 copy on the CPU
 * converts element by element through a slow generic path (~10 ns an element measured, against ~1 ns
 * here). Built and loaded by fp8.py like the other kernels (cpu_decode.py). */
#include <stdint.h>

void fp8_widen_rows(const uint8_t *q, const float *scale, const float *table, int64_t n, int64_t k,
                    float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = q + r * k;
        float s = scale[r], *dst = out + r * k;
        for (int64_t i = 0; i < k; i++) dst[i] = table[row[i]] * s;
    }
}
