/* Linked into every kernel library: which instruction sets the compiler targeted (the flag set's
 * outcome, as the code's own #if tests see it), for kernels/build.py's report (`pagedllm env`). Bit
 * i set: ISA_BITS[i] in build.py. */
#include <stdint.h>

int64_t kernel_isa(void) {
    int64_t bits = 0;
#ifdef __AVX2__
    bits |= 1 << 0;
#endif
#ifdef __FMA__
    bits |= 1 << 1;
#endif
#ifdef __F16C__
    bits |= 1 << 2;
#endif
#ifdef __AVX512F__
    bits |= 1 << 3;
#endif
#ifdef __AVX512BF16__
    bits |= 1 << 4;
#endif
#ifdef __AVX512VNNI__
    bits |= 1 << 5;
#endif
#ifdef __AMX_TILE__
    bits |= 1 << 6;
#endif
#ifdef _OPENMP
    bits |= 1 << 7;
#endif
    return bits;
}
