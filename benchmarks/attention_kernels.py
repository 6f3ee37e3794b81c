"""The native CPU decode-attention kernel (cpu_decode.c) at SmolLM2-135M's head layout (9 query heads,
3 kv heads, head size 64, 16-key blocks): time per layer call for 1, 2, 4, 8 query rows per sequence
(a decode step, and the 1 + k rows of a step verifying k drafted tokens), and for a 256-sequence
decode batch of ~500-token contexts, with float32, bfloat16 and fp8 (e4m3) caches.

With `--baseline REV` the kernel library is also built from that git revision's sources and each
case is timed on both, interleaved (old, new, old, new, ...), so the two see the same machine load;
the kernels' C interface (StepArgs, LayerArgs) must be the same in both.

Run: `PYTHONPATH=$PWD python benchmarks/attention_kernels.py [--baseline main] [--rounds 5]`
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from revision_kernels import build_units

from pagedllm.attention import fp8_kv
from pagedllm.attention.backends import cpu_decode

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 16
# (label, activations' dtype, cache dtype)
DTYPES = [
    ("f32", torch.float32, torch.float32),
    ("bf16", torch.bfloat16, torch.bfloat16),
    ("fp8", torch.bfloat16, torch.float8_e4m3fn),
]
SCALES = torch.tensor([0.05, 0.04])


def baseline_library(rev: str) -> ctypes.CDLL:
    """The attention kernels built from `rev`'s sources."""
    lib = build_units(rev, ("attention_decode.c", "attention_prefill.c"))
    for suffix in ("f32", "bf16"):
        fn = getattr(lib, f"decode_layer_{suffix}")
        fn.argtypes, fn.restype = cpu_decode._DECODE_ARGTYPES, ctypes.c_int
    return lib


def make_case(
    seq_lens_per_seq: list[int], rows: int, act: torch.dtype, cache_dtype: torch.dtype
) -> tuple[Callable[[ctypes._CFuncPtr], None], torch.Tensor]:
    """A decode call of `rows` query rows per sequence (row j of a sequence of length L attends to
    its first L - rows + 1 + j keys) over a cache filled with random values, and its output tensor."""
    gen = torch.Generator().manual_seed(0)
    blocks = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in seq_lens_per_seq]
    num_blocks = sum(blocks) + 1
    cache = torch.randn(2, num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_SIZE, generator=gen)
    cache = fp8_kv.quantize(cache, 1.0, cache_dtype) if fp8_kv.is_fp8(cache_dtype) else cache.to(cache_dtype)
    # Each sequence's blocks in a random order, as a long-running pool hands them out.
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[used : used + n].int()
        used += n
    num_rows = rows * len(seq_lens_per_seq)
    q = torch.randn(num_rows, HEADS * HEAD_SIZE, generator=gen).to(act)
    out = torch.empty_like(q)
    table_rows = torch.arange(len(blocks)).repeat_interleave(rows)
    offsets = torch.arange(rows).repeat(len(blocks))
    seq_lens = torch.tensor(seq_lens_per_seq).repeat_interleave(rows) - rows + 1 + offsets
    step = cpu_decode.DecodeStep(tables, torch.arange(num_rows), table_rows, seq_lens, None)
    layout = cpu_decode.DecodeLayout(HEADS, cache, HEAD_SIZE**-0.5, 0, 0.0, act)
    scales = SCALES if fp8_kv.is_fp8(cache_dtype) else None
    kv = q[:0].view(0, HEADS, HEAD_SIZE)

    def call(fn: ctypes._CFuncPtr) -> None:
        status = fn(
            q.data_ptr(), q.stride(0), kv.data_ptr(), 0, kv.data_ptr(), 0, cache.data_ptr(),
            None if scales is None else scales.data_ptr(), out.data_ptr(), out.stride(0),
            step.pointer, layout.pointer,
        )  # fmt: skip
        assert status == 0

    call.keep = (cache, tables, q, step, layout, scales)  # type: ignore[attr-defined]
    return call, out


def time_calls(call: Callable[[], None], seconds: float, clock: Callable[[], float]) -> float:
    """ms per call: the best of 5 batches filling about `seconds` (the least disturbed by other load)."""
    call()
    start = clock()
    call()
    once = clock() - start
    iters = max(1, int(seconds / 5 / max(once, 1e-6)))
    samples = []
    for _ in range(5):
        start = clock()
        for _ in range(iters):
            call()
        samples.append((clock() - start) / iters * 1e3)
    return min(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="git revision whose kernel to time beside this tree's")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case (median)")
    parser.add_argument("--seconds", type=float, default=0.2, help="time per measurement")
    parser.add_argument("--context", type=int, default=512, help="keys per sequence")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 16], help="sequences in the rows cases")
    parser.add_argument("--dtypes", nargs="+", default=[d[0] for d in DTYPES])
    parser.add_argument(
        "--threads", type=int, default=1, help="OpenMP threads (1: per-core cost, least disturbed by load)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # One thread runs the kernel on this one: its CPU time is the kernel's, whatever else the cores
    # run; with more, wall time.
    clock = time.thread_time if args.threads == 1 else time.perf_counter

    new = cpu_decode.kernel()
    assert new is not None
    libs = {"new": new}
    if args.baseline:
        libs = {"old": baseline_library(args.baseline), "new": new}
    gen = torch.Generator().manual_seed(1)
    cases: list[tuple[str, list[int], int]] = [
        (f"{s} seq x {r} rows", [args.context] * s, r) for s in args.seqs for r in (1, 2, 4, 8)
    ]
    batch = torch.randint(args.context - 100, args.context + 100, (256,), generator=gen).tolist()
    cases.append(("256 seq x 1 row", batch, 1))
    clock_name = "thread CPU" if args.threads == 1 else "wall"
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"threads {torch.get_num_threads()} ({clock_name} time), load {load}")
    print(f"{'case':<18} {'dtype':<5} " + " ".join(f"{name + ' ms':>9}" for name in libs) + "   new/old")
    for label, act, cache_dtype in DTYPES:
        if label not in args.dtypes:
            continue
        for name, lens, rows in cases:
            call, out = make_case(lens, rows, act, cache_dtype)
            results: dict[str, list[float]] = {k: [] for k in libs}
            outs = {}
            for _ in range(args.rounds):
                for key, lib in libs.items():
                    fn = getattr(lib, f"decode_layer_{cpu_decode._SUFFIXES[act]}")
                    results[key].append(time_calls(lambda fn=fn, call=call: call(fn), args.seconds, clock))
                    outs[key] = out.clone()
            ms = {k: statistics.median(v) for k, v in results.items()}
            line = f"{name:<18} {label:<5} " + " ".join(f"{ms[k]:9.3f}" for k in libs)
            if "old" in ms:
                diff = (outs["old"].float() - outs["new"].float()).abs().max().item()
                line += f"   {ms['new'] / ms['old']:.2f}x  (max |old - new| {diff:.1e})"
            print(line, flush=True)


if __name__ == "__main__":
    main()
