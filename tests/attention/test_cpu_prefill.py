"""The bfloat16 prompt-attention kernel (kernels/cpu/attention_prefill.c) called directly through its
binding (`cpu_decode.prefill_layer`), against causal attention in float64 over the same bfloat16
queries, keys and values: fresh prompts and chunks over a cached prefix in one call, grouped-query
and multi-head layouts, head sizes of its specialized copies and others, sliding windows and soft
caps, lengths across its 16-key chunks and 64-key blocks, beside the cache's never-written (NaN)
slots; a row's result bitwise the same however the step is cut (batch invariance); and each
instruction-set build: the AVX512-BF16 code where the CPU has it, no prompt kernel in builds without
it (the backend then keeps torch's attention)."""

from __future__ import annotations

import pytest
import torch
from kernel_builds import FORCED_SETS, forced_flag_set
from paged_batch import shuffled_block_tables

from pagedllm.attention.backends import cpu_decode

BLOCK = 16
# bfloat16 outputs of values ~N(0, 1): the output's own rounding (2^-9 relative) and the kernel's
# bfloat16 probabilities; a wrong key, mask or rescaling is off by ~0.1 or more.
ATOL = 1.5e-2


def _skip_without_kernel() -> None:
    lib = cpu_decode.kernel()
    if lib is None or not lib.prefill_supported():
        pytest.skip("the prompt kernel needs AVX512-BF16 (and a C compiler), which this machine lacks")


def _cache(lengths: list[int], kv_heads: int, head_size: int, gen: torch.Generator, block: int = BLOCK):
    """A bfloat16 cache holding each request's keys and values in shuffled blocks (slots past a
    request's keys hold NaN), and its block tables."""
    num_blocks = sum((n + block - 1) // block for n in lengths) + 1
    cache = torch.randn(2, num_blocks, kv_heads, block, head_size, generator=gen).bfloat16()
    tables = shuffled_block_tables(cache, lengths, gen)
    return cache, tables


def _run(q, cache, tables, segments, heads, window=0, soft_cap=0.0) -> torch.Tensor:
    """The kernel's output for `segments`: (first query row, rows, cached tokens, request) each."""
    head_size = cache.shape[-1]
    layout = cpu_decode.DecodeLayout(heads, cache, head_size**-0.5, window, soft_cap)
    assert layout.prefill_fn is not None
    out = torch.full_like(q, float("nan"))
    step = cpu_decode.PrefillStep(tables, torch.tensor(segments, dtype=torch.int64))
    cpu_decode.prefill_layer(q, cache, out, step, layout)
    return out


def _reference(q, cache, tables, req: int, positions: torch.Tensor, heads: int, window: int, soft_cap: float):
    """float64 causal attention of `q` [rows, heads, D] at `positions` over request `req`'s keys."""
    head_size = q.shape[-1]
    kv_heads, block = cache.shape[2], cache.shape[3]
    n = int(positions.max()) + 1
    ids = tables[req, : (n + block - 1) // block].long()
    k, v = (cache[i, ids].double().transpose(1, 2).reshape(-1, kv_heads, head_size)[:n] for i in range(2))
    group = heads // kv_heads
    scores = torch.einsum("qhd,shd->hqs", q.double(), k.repeat_interleave(group, 1)) * head_size**-0.5
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = positions[:, None]
    k_pos = torch.arange(n)[None]
    visible = k_pos <= q_pos
    if window:
        visible &= k_pos > q_pos - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqs,shd->qhd", probs, v.repeat_interleave(group, 1))


def _check(
    prompts: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_size: int,
    window: int = 0,
    soft_cap: float = 0.0,
    block: int = BLOCK,
    rows_checked: slice = slice(None),
) -> None:
    """One call for all `prompts` ((cached tokens, new rows) each); each prompt's rows (those of
    `rows_checked`) against the reference."""
    gen = torch.Generator().manual_seed(0)
    cache, tables = _cache([c + n for c, n in prompts], kv_heads, head_size, gen, block)
    q = torch.randn(sum(n for _, n in prompts), heads, head_size, generator=gen).bfloat16()
    segments, start = [], 0
    for req, (cached, rows) in enumerate(prompts):
        segments.append([start, rows, cached, req])
        start += rows
    out = _run(q, cache, tables, segments, heads, window, soft_cap)
    for start, rows, cached, req in segments:
        picked = torch.arange(rows)[rows_checked]
        ref = _reference(q[start + picked], cache, tables, req, cached + picked, heads, window, soft_cap)
        torch.testing.assert_close(out[start + picked].double(), ref, atol=ATOL, rtol=0, msg=f"request {req}")


# Fresh prompts and chunks over cached prefixes side by side, lengths across chunk and block edges.
PROMPTS = [(0, 300), (0, 17), (77, 64), (128, 50), (5, 1), (0, 129)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_size"),
    [(32, 8, 64), (9, 3, 64), (4, 4, 128), (8, 1, 32), (6, 2, 96)],
    ids=["llama-1b", "smollm2", "mha-128", "mqa-32", "gqa-96"],
)
def test_prompts_match_float64_reference(heads: int, kv_heads: int, head_size: int) -> None:
    """The 1B Llama's and SmolLM2's layouts (64: a specialized copy), 128 (the other), and head sizes
    of 32 and 96 through the general code (value sums 32 dimensions at a time)."""
    _skip_without_kernel()
    _check(PROMPTS, heads, kv_heads, head_size)


@pytest.mark.parametrize(
    ("window", "soft_cap", "block"), [(21, 0.0, 16), (100, 0.0, 32), (0, 0.7, 16), (40, 30.0, 32)]
)
def test_windows_soft_caps_and_block_sizes(window: int, soft_cap: float, block: int) -> None:
    """Windows shorter and longer than a key block (rows whose window starts mid-block, blocks no row
    of a run sees), soft caps small and large, cache blocks of 16 and 32 keys."""
    _skip_without_kernel()
    _check(PROMPTS, 8, 2, 64, window, soft_cap, block)


def test_long_prompt() -> None:
    """2048 tokens: a long online softmax (many running-maximum rescalings); every 37th row checked."""
    _skip_without_kernel()
    _check([(0, 2048)], 8, 2, 64, rows_checked=slice(None, None, 37))


@pytest.mark.parametrize("window", [0, 50])
def test_rows_are_batch_invariant(window: int) -> None:
    """A row's output is bitwise the same however the step is cut: in its whole prompt, in a chunk
    over the cached rest, alone as a one-row segment (a decode row), or beside other segments."""
    _skip_without_kernel()
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_size, length = 9, 3, 64, 200
    cache, tables = _cache([length, 90], kv_heads, head_size, gen)
    q = torch.randn(length + 90, heads, head_size, generator=gen).bfloat16()
    run = lambda segments: _run(q, cache, tables, segments, heads, window)  # noqa: E731
    whole = run([[0, length, 0, 0]])[:length]
    chunked = run([[0, 70, 0, 0], [70, 61, 70, 0], [131, length - 131, 131, 0]])[:length]
    assert torch.equal(chunked, whole)
    beside = run([[length, 90, 0, 1], [0, length, 0, 0]])[:length]
    assert torch.equal(beside, whole)
    for row in (0, 15, 16, 63, 64, 65, 130, length - 1):
        alone = run([[row, 1, row, 0]])[row]
        assert torch.equal(alone, whole[row]), f"row {row}"


def test_avx512_bf16_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel built with the named AVX512-BF16 flag set (the one CPUs without -march=native's
    extras take) matches the reference too."""
    with forced_flag_set(monkeypatch, "avx512-bf16"):
        assert cpu_decode.kernel().prefill_supported()
        _check(PROMPTS[:4], 9, 3, 64, window=33)


@pytest.mark.parametrize("flag_set", FORCED_SETS)
def test_builds_without_bf16_serve_no_prompts(flag_set: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Builds for CPUs without AVX512-BF16 have no prompt kernel: the layout says so, so the backend
    runs prompts through torch's attention (tests/attention/test_torch_paged.py checks that path)."""
    with forced_flag_set(monkeypatch, flag_set):
        lib = cpu_decode.kernel()
        assert not lib.prefill_supported()
        cache = torch.zeros(2, 4, 2, BLOCK, 64, dtype=torch.bfloat16)
        assert cpu_decode.DecodeLayout(8, cache, 0.125, 0).prefill_fn is None
