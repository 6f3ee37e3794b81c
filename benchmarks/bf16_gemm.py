"""The batch-invariant bfloat16 product (kernels/cpu/bf16_gemm.c) against torch's bf16 linear
(oneDNN) on SmolLM2-135M's and a 1B Llama's layer shapes, at 1, 8, 64 and 512 rows, with 1 and 2
threads: best-of-N CPU seconds of the process (and wall seconds) per call, the products alternating
call by call so both see the same machine load. Up to 8 rows (decode) read their weights from
DRAM, as a decode step does (copies in rotation, `--cold-mb`); more rows reuse one copy.

With `--baseline REV` the kernel is also built from that git revision's bf16_gemm.c (with this tree's
headers) and timed in the same alternation, for an A/B of a kernel change.

Run: `PYTHONPATH=$PWD python benchmarks/bf16_gemm.py [--baseline main] [--repeats 15]
[--rows 1,8,64,512] [--threads 1,2] [--models smollm2,1b]`
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from revision_kernels import build_units

from pagedllm.layers import bf16_gemm

# (out features, in features) of each model's products: fused qkv / o, gate_up, down, and the
# separate q and kv widths of the attention projections.
SHAPES = {
    "smollm2": [(1536, 576), (576, 1536), (576, 576), (192, 576)],
    "1b": [(8192, 2048), (2048, 8192), (2048, 2048), (512, 2048)],
}


def baseline_kernel(rev: str) -> ctypes.CDLL:
    """`rev`'s bf16_gemm.c built alone with the kernel builder's flags for this CPU (-march=native)."""
    lib = build_units(rev, ("bf16_gemm.c",))
    lib.bf16_gemm.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        *[ctypes.c_void_p] * 3,
        *[ctypes.c_int64] * 3,
        ctypes.c_int,
    ]
    lib.bf16_gemm.restype = ctypes.c_int
    return lib


def rotation(ws: list[torch.Tensor], fn: Callable[[torch.Tensor], object]) -> Callable[[], object]:
    """`fn` on the next of the weight copies at each call."""
    turn = iter(range(1 << 62))
    return lambda: fn(ws[next(turn) % len(ws)])


def call_of(lib: ctypes.CDLL, x: torch.Tensor, ws: list[torch.Tensor]) -> Callable[[], object]:
    m, k = x.shape
    n = ws[0].shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    return rotation(
        ws, lambda w: lib.bf16_gemm(x.data_ptr(), k, w.data_ptr(), None, y.data_ptr(), m, n, k, 0)
    )


def best_of(
    calls: dict[str, Callable[[], object]], repeats: int, budget_s: float
) -> dict[str, tuple[float, float]]:
    """Per call, the least (CPU seconds, wall seconds) over up to `repeats` rounds (fewer where a round
    of all calls exceeds the budget's share), the calls alternating within each round."""
    best = {name: (float("inf"), float("inf")) for name in calls}
    for fn in calls.values():
        fn()  # warm-up: page in, build
    started = time.perf_counter()
    for _ in range(repeats):
        for name, fn in calls.items():
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            c1, w1 = time.process_time(), time.perf_counter()
            best[name] = (min(best[name][0], c1 - c0), min(best[name][1], w1 - w0))
        if time.perf_counter() - started > budget_s:
            break
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,64,512")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--models", default="smollm2,1b")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--budget", type=float, default=6.0, help="seconds per case at most")
    parser.add_argument(
        "--cold-mb",
        type=int,
        default=256,
        help="weight copies of this many MB in rotation for up to 8 rows, so they come from DRAM as in decode (0: one)",
    )
    parser.add_argument("--baseline", help="a git revision whose bf16_gemm.c to time as well")
    args = parser.parse_args()
    assert bf16_gemm.available(), "the kernel needs AVX512-BF16 and a C compiler"
    new = bf16_gemm._library()
    assert new is not None
    old = baseline_kernel(args.baseline) if args.baseline else None
    print(
        f"{'model':8} {'n x k':>12} {'M':>4} {'thr':>3}  {'oneDNN ms':>9} {'kernel ms':>9} {'ratio':>6}"
        + (f" {'base ms':>9} {'new/base':>8}" if old else "")
        + "   (CPU ms, best; ratio = oneDNN/kernel)"
    )
    gen = torch.Generator().manual_seed(0)
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for model in args.models.split(","):
            for n, k in SHAPES[model]:
                w = torch.randn(n, k, generator=gen).bfloat16()
                copies = [w] + [w.clone() for _ in range(args.cold_mb * 2**20 // (n * k * 2))]
                for m in map(int, args.rows.split(",")):
                    x = torch.randn(m, k, generator=gen).bfloat16()
                    ws = copies if m <= 8 else [w]
                    calls: dict[str, Callable[[], object]] = {
                        "onednn": rotation(ws, lambda w, x=x: F.linear(x, w)),
                        "kernel": call_of(new, x, ws),
                    }
                    if old is not None:
                        calls["base"] = call_of(old, x, ws)
                    best = best_of(calls, args.repeats, args.budget)
                    ms = {name: cpu * 1e3 for name, (cpu, _) in best.items()}
                    line = (
                        f"{model:8} {f'{n}x{k}':>12} {m:4} {threads:3}  {ms['onednn']:9.3f} {ms['kernel']:9.3f}"
                        f" {ms['onednn'] / ms['kernel']:6.2f}"
                    )
                    if old is not None:
                        line += f" {ms['base']:9.3f} {ms['kernel'] / ms['base']:8.2f}"
                    print(line, flush=True)


if __name__ == "__main__":
    main()
