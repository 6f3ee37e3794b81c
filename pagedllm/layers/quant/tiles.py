"""The batched product of quantized layers: tiles of weight rows widened to float into a reused
buffer and multiplied by torch's GEMM, so that no float copy of the whole weight ever exists.

The tiles are float32 unless the caller's widening can write bfloat16 and `gemm_dtype` picks it: bf16
activations on a CPU with native bf16 dot products (AVX512-BF16, AMX), where torch's bf16 GEMM runs
several times its float32 one; elsewhere the float32 GEMM is the faster (figures: benchmarks/RESULTS.md,
"Figures behind code choices"). The bf16 tiles round each weight to bf16 (8 significant bits, as a bf16
model's own weights are); the float32 ones are exact.

Each tile's product is written in place into its columns of the preallocated output (a column block
of a row-major matrix is a valid GEMM destination: its row stride is the leading dimension), so the
output is neither concatenated from pieces nor transposed afterwards.

The widening kernels run on one thread: an OpenMP region around them made them many times slower on a
loaded machine, its second thread waiting for a core; the GEMMs between the tiles use every thread.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.platforms.cpu import CpuPlatform

# The float32 scratch of one tile (transient: freed with the product's call). Each tile is one GEMM
# call, and on a loaded machine each call costs more than the cache misses of a large tile (figures:
# benchmarks/RESULTS.md, "Figures behind code choices"): at 32 MB every projection of a small model is
# one tile, the LM head a few.
TILE_BYTES = 32 << 20


def tile_rows(in_features: int, element_bytes: int = 4) -> int:
    """Weight rows per tile for rows of `in_features` elements of `element_bytes` (at least one)."""
    return max(1, TILE_BYTES // (element_bytes * in_features))


def gemm_dtype(activations: torch.dtype) -> torch.dtype:
    """The tiles' dtype for activations of `activations`: bf16 where they are bf16 and the CPU has
    native bf16 dot products, else float32."""
    if activations == torch.bfloat16 and CpuPlatform.has_native_bf16():
        return torch.bfloat16
    return torch.float32


def tiled_product(
    x: torch.Tensor,
    out_features: int,
    widen: Callable[[slice, torch.Tensor], None],
    tile_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`x @ W^T` for `x` [M, in], where `widen(rows, tile)` writes W[rows] into `tile` (of
    `tile_dtype`: float32, or bfloat16 from `gemm_dtype`); the GEMM runs in that dtype."""
    m, k = x.shape
    xt = x.to(tile_dtype)
    out = torch.empty(m, out_features, dtype=tile_dtype)
    step = max(1, min(tile_rows(k, tile_dtype.itemsize), out_features))
    tile = torch.empty(step, k, dtype=tile_dtype)
    for start in range(0, out_features, step):
        rows = slice(start, min(start + step, out_features))
        n = rows.stop - start
        widen(rows, tile[:n])
        torch.mm(xt, tile[:n].t(), out=out[:, rows])
    return out.to(x.dtype)
