"""The native decode kernel (cpu_decode.c) called directly, against attention in float64 over the
cache it reads: requests with up to MAX_DECODE_QUERY_LEN rows (draft verification; each row of one
request shares its key reads), at the head sizes its copies specialize and others, every cache type,
with sliding windows and soft caps, work split over a long request's keys; and the same kernel built
for AVX2 (8-float vectors) and without vector extensions (the generic vector code that runs where
neither AVX2 nor AVX-512 does), whatever this machine has."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kernel_builds import FORCED_SETS, forced_flag_set
from paged_batch import shuffled_block_tables

from pagedllm.attention import fp8_kv
from pagedllm.attention.backends import cpu_decode
from pagedllm.attention.backends.torch_paged_metadata import MAX_DECODE_QUERY_LEN

BLOCK = 16
CACHES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
# An fp8 cache holds x / scale: up to ~4 / 0.015, within e4m3's range.
SCALES = torch.tensor([0.02, 0.015])


def _check_decode(
    rows_per_request: list[int],
    lengths: list[int],
    heads: int,
    kv_heads: int,
    head_size: int,
    cache_dtype: torch.dtype,
    window: int = 0,
    soft_cap: float = 0.0,
) -> None:
    """Request i has lengths[i] keys and its last rows_per_request[i] tokens as decode rows (row j of
    r attends to the first lengths[i] - r + 1 + j keys); checks every row's output."""
    fp8 = fp8_kv.is_fp8(cache_dtype)
    act = torch.bfloat16 if cache_dtype == torch.bfloat16 or fp8 else torch.float32
    gen = torch.Generator().manual_seed(0)
    blocks = [(n + BLOCK - 1) // BLOCK for n in lengths]
    num_blocks = sum(blocks) + 1
    values = torch.randn(2, num_blocks, kv_heads, BLOCK, head_size, generator=gen)
    if fp8:
        cache = torch.stack([fp8_kv.quantize(values[i], SCALES[i], cache_dtype) for i in range(2)])
        stored = torch.stack([fp8_kv.dequantize(cache[i], SCALES[i], torch.float64) for i in range(2)])
    else:
        cache = values.to(cache_dtype)
        stored = cache.double()
    tables = shuffled_block_tables(cache, lengths, gen)
    reqs = torch.arange(len(lengths)).repeat_interleave(torch.tensor(rows_per_request))
    first_row = torch.cumsum(torch.tensor([0, *rows_per_request[:-1]]), 0).repeat_interleave(
        torch.tensor(rows_per_request)
    )
    offset = torch.arange(reqs.numel()) - first_row
    seq_lens = torch.tensor(lengths)[reqs] - torch.tensor(rows_per_request)[reqs] + 1 + offset
    q = torch.randn(reqs.numel(), heads, head_size, generator=gen).to(act)
    out = torch.full_like(q, float("nan"))
    layout = cpu_decode.DecodeLayout(heads, cache, head_size**-0.5, window, soft_cap, act)
    step = cpu_decode.DecodeStep(tables, torch.arange(reqs.numel()), reqs, seq_lens, None)
    empty = q.new_empty(0, kv_heads, head_size)
    cpu_decode.decode_layer(q, empty, empty, cache, SCALES if fp8 else None, out, step, layout)

    group = heads // kv_heads
    for row, (req, n) in enumerate(zip(reqs.tolist(), seq_lens.tolist(), strict=True)):
        ids = tables[req, : (n + BLOCK - 1) // BLOCK].long()
        k, v = (stored[i, ids].transpose(1, 2).reshape(-1, kv_heads, head_size)[:n] for i in range(2))
        scores = torch.einsum("hd,shd->hs", q[row].double(), k.repeat_interleave(group, 1)) * head_size**-0.5
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        if window:
            scores[:, : max(n - window, 0)] = float("-inf")
        ref = torch.einsum("hs,shd->hd", scores.softmax(-1), v.repeat_interleave(group, 1))
        atol = 1e-5 if act == torch.float32 else 2e-2
        torch.testing.assert_close(out[row].double(), ref, atol=atol, rtol=0, msg=f"row {row}")


# Requests of 1 to MAX_DECODE_QUERY_LEN rows side by side, lengths across block boundaries.
ROWS = [1, 3, MAX_DECODE_QUERY_LEN, 2, 1, 5]
LENGTHS = [37, 16, 70, 9, 129, 48]


@pytest.mark.parametrize("cache_dtype", CACHES, ids=str)
@pytest.mark.parametrize("head_size", [64, 128, 32], ids=lambda d: f"d{d}")
def test_request_rows_match_reference(cache_dtype: torch.dtype, head_size: int) -> None:
    """SmolLM2's head layout (9 query heads over 3 kv heads); 64 and 128 run the kernel's copies for
    a constant head size, 32 its general code."""
    _check_decode(ROWS, LENGTHS, 9, 3, head_size, cache_dtype)


@pytest.mark.parametrize("cache_dtype", CACHES, ids=str)
def test_windows_and_soft_caps(cache_dtype: torch.dtype) -> None:
    """Each row's own window start (rows of one request start theirs at different keys)."""
    _check_decode(ROWS, LENGTHS, 4, 2, 64, cache_dtype, window=21, soft_cap=2.0)


@pytest.mark.parametrize("cache_dtype", CACHES, ids=str)
def test_long_request_split_over_threads(cache_dtype: torch.dtype) -> None:
    """One request with one kv head: fewer work items than threads, so its keys are split and the
    parts merged (on one thread the same code runs unsplit)."""
    _check_decode([5], [700], 4, 1, 64, cache_dtype)


def test_runs_cut_to_the_query_buffer() -> None:
    """16 query heads per kv head of 256 dimensions: a request's 8 rows are more query vectors than
    a work item holds, so its rows go in several runs."""
    _check_decode([MAX_DECODE_QUERY_LEN, 1], [40, 20], 16, 1, 256, torch.float32)


@pytest.fixture(params=FORCED_SETS)
def forced_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernel library built with a flag set below -march=native's (AVX2, or no AVX on x86-64)."""
    with forced_flag_set(monkeypatch, request.param):
        yield


@pytest.mark.parametrize("cache_dtype", CACHES, ids=str)
def test_forced_builds_match_reference(cache_dtype: torch.dtype, forced_kernel: None) -> None:
    _check_decode(ROWS, LENGTHS, 9, 3, 64, cache_dtype)
    _check_decode(ROWS, LENGTHS, 4, 2, 32, cache_dtype, window=21, soft_cap=2.0)
