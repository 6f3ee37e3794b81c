"""The quantized linear products by activation rows, per weight type: the int8 / native kernel, the
dequantized tiles + float32 GEMM (`tiles.tiled_product`), and the float32 GEMM on a dequantized copy
(the float path's cost), on one layer shape (default 3072 x 768: SmolLM2-135M's fused gate/up rows, its width rounded up to whole 256-element
K-quant blocks).
Where the kernel column stops beating the tiles column is the row switch (`gguf.int8_max_rows`,
`int4.MATMUL_MAX_ROWS`). Interleaved: each row count times the three products in turn, best of
`--repeats`.

Run: `PYTHONPATH=$PWD python benchmarks/quant_linear.py [--out 3072 --in 768 --rows 1,2,4,8,12,16,32,256]`.
Random blocks (valid float16 scales), torch's default thread count.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from pagedllm.layers.quant import gguf_native, int4_native
from pagedllm.layers.quant.int4_native import Int4Weight
from pagedllm.layers.quant.tiles import tiled_product

# Per type: (block elements, block bytes, offsets of the block's float16 scales).
_BLOCKS = {
    Q.Q4_0: (32, 18, (0,)),
    Q.Q4_1: (32, 20, (0, 2)),
    Q.Q5_0: (32, 22, (0,)),
    Q.Q5_1: (32, 24, (0, 2)),
    Q.Q8_0: (32, 34, (0,)),
    Q.Q2_K: (256, 84, (80, 82)),
    Q.Q3_K: (256, 110, (108,)),
    Q.Q4_K: (256, 144, (0, 2)),
    Q.Q5_K: (256, 176, (0, 2)),
    Q.Q6_K: (256, 210, (208,)),
}


def gguf_weight(qtype: Q, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    elems, size, offsets = _BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(n, k // elems, size), dtype=np.uint8)
    for off in offsets:
        raw[..., off : off + 2] = rng.uniform(1e-4, 1e-3, (n, k // elems, 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def best_ms(fn: Callable[[torch.Tensor], object], x: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return best * 1000.0


def products(
    name: str, n: int, k: int, rng: np.random.Generator
) -> tuple[Callable[[torch.Tensor], object], Callable[[slice, torch.Tensor], None]]:
    """(the kernel's product of x, the tiles' widen) of a random weight of type `name`."""
    if name == "int4":
        group = 64
        weight = Int4Weight(
            torch.from_numpy(rng.integers(0, 256, (n, k // 2), dtype=np.uint8)),
            torch.from_numpy(rng.uniform(1e-3, 1e-2, (n, k // group)).astype(np.float16)),
            torch.from_numpy(rng.integers(0, 16, (n, k // group), dtype=np.uint8)),
            group,
        )

        def kernel(x: torch.Tensor) -> object:
            return int4_native.matmul(x, weight, torch.empty(x.shape[0], n))

        def widen(rows: slice, tile: torch.Tensor) -> None:
            int4_native.dequantize_rows(Int4Weight(weight[0][rows], weight[1][rows], weight[2][rows], group), tile)

        return kernel, widen
    qtype = int(Q[name])
    packed = gguf_weight(Q[name], n, k, rng)

    def gguf_kernel(x: torch.Tensor) -> object:
        return gguf_native.matmul(x, [packed], [qtype], k, torch.empty(x.shape[0], n))

    def gguf_widen(rows: slice, tile: torch.Tensor) -> None:
        gguf_native.dequantize_rows(packed[rows], qtype, k, tile)

    return gguf_kernel, gguf_widen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=int, default=3072)
    parser.add_argument("--in", dest="k", type=int, default=768)
    parser.add_argument("--rows", default="1,2,4,8,12,16,32,256")
    parser.add_argument("--types", default=",".join([t.name for t in _BLOCKS] + ["int4"]))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n, k = args.out, args.k
    rng = np.random.default_rng(0)
    dense = torch.randn(n, k)
    print(f"{n} x {k}, {torch.get_num_threads()} threads; ms: kernel / tiles / float GEMM")
    for name in args.types.split(","):
        kernel, widen = products(name, n, k, rng)
        cells = []
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k)
            tiled = functools.partial(tiled_product, out_features=n, widen=widen)
            times = [best_ms(f, x, args.repeats) for f in (kernel, tiled, dense.t().__rmatmul__)]
            cells.append(f"{m}: " + "/".join(f"{t:.2f}" for t in times))
        print(f"{name:5s} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
