"""The batched product of quantized layers: tiles of weight rows widened to float32 into a reused
buffer and multiplied by torch's GEMM, so that no float copy of the whole weight ever exists.

float32 whatever the activations: on CPUs without bfloat16 matrix instructions torch's float32 GEMM is
several times faster than its bfloat16 one (figures: benchmarks/RESULTS.md, "Figures behind code
choices").

Each tile's product is written in place into its columns of the preallocated output (a column block
of a row-major matrix is a valid GEMM destination: its row stride is the leading dimension), so the
output is neither concatenated from pieces nor transposed afterwards.

The widening kernels run on one thread: an OpenMP region around them made them many times slower on a
loaded machine, its second thread waiting for a core; the GEMMs between the tiles use every thread.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# The float32 scratch of one tile (transient: freed with the product's call). Each tile is one GEMM
# call, and on a loaded machine each call costs more than the cache misses of a large tile (figures:
# benchmarks/RESULTS.md, "Figures behind code choices"): at 32 MB every projection of a small model is
# one tile, the LM head a few.
TILE_BYTES = 32 << 20


def tile_rows(in_features: int) -> int:
    """Weight rows per tile for rows of `in_features` float32 elements (at least one)."""
    return max(1, TILE_BYTES // (4 * in_features))


def tiled_product(
    x: torch.Tensor, out_features: int, widen: Callable[[slice, torch.Tensor], None]
) -> torch.Tensor:
    """`x @ W^T` for `x` [M, in], where `widen(rows, tile)` writes W[rows] as float32 into `tile`."""
    m, k = x.shape
    xf = x.float()
    out = torch.empty(m, out_features, dtype=torch.float32)
    step = max(1, min(tile_rows(k), out_features))
    tile = torch.empty(step, k, dtype=torch.float32)
    for start in range(0, out_features, step):
        rows = slice(start, min(start + step, out_features))
        n = rows.stop - start
        widen(rows, tile[:n])
        torch.mm(xf, tile[:n].t(), out=out[:, rows])
    return out.to(x.dtype)
