"""The batched product of quantized layers: tiles of weight rows widened to float32 into a reused
buffer and multiplied by torch's GEMM, so that no float copy of the whole weight ever exists.

float32 whatever the activations: on CPUs without bfloat16 matrix instructions torch's float32 GEMM is
several times its bfloat16 one (measured: 32 x 576 x 3072 in 3.9 vs 23.6 ms on this 2-core AVX2
machine).

Each tile's product is written in place into its columns of the preallocated output (a column block
of a row-major matrix is a valid GEMM destination: its row stride is the leading dimension), so the
output is neither concatenated from pieces nor transposed afterwards.

The widening kernels run on one thread: a 3072 x 576 Q4_1 weight takes 0.25 ms, and an OpenMP region
around it made it 48 ms (median) on this 2-core VM under load, its second thread waiting for a core;
the GEMMs between the tiles use every thread.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# The float32 scratch of one tile (transient: freed with the product's call). Each tile is one GEMM
# call, and on this 2-core VM under load each call costs more than the cache misses of a large tile
# (in the GGUF path at 256 rows, medians: SmolLM2's 49152 x 576 Q8_0 LM head 801 / 639 / 594 / 573 ms
# with 4 / 8 / 16 / 32 MB tiles against 487 ms for one float GEMM; its 3072 x 576 gate/up 53 / 47 / 48
# / 36 ms against 36 ms): at 32 MB every projection of a small model is one tile, the LM head a few.
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
