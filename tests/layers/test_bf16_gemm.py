"""The batch-invariant bfloat16 product against a float64 reference, and its invariance: a row's result
is bitwise the same at any row count (one row, a few streamed rows, tiled many), at any place among
the rows and with any number of threads; float32 output is the bfloat16 output before its rounding.
The LM head computes bfloat16 logits with it, in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers import bf16_gemm
from pagedllm.layers.embedding import LogitsProcessor, ParallelLMHead

pytestmark = pytest.mark.skipif(not bf16_gemm.available(), reason="needs a C compiler and AVX512-BF16")


@pytest.mark.parametrize(
    # 576: whole 32-element chunks; 100 a ragged last chunk; 7 only that; n = 33 and 5 leave part of a
    # 16-column group.
    ("n", "k"),
    [(96, 576), (33, 100), (5, 7), (40, 1536)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64(n: int, k: int, with_bias: bool) -> None:
    torch.manual_seed(n * k)
    x, w = torch.randn(37, k).bfloat16(), torch.randn(n, k).bfloat16()
    bias = torch.randn(n).bfloat16() if with_bias else None
    ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    out = bf16_gemm.bf16_linear(x, w, bias, float_out=True)
    # The products are exact and the sums float: off by float rounding only.
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
    # bfloat16 out: the float result rounded once.
    assert torch.equal(bf16_gemm.bf16_linear(x, w, bias), out.bfloat16())


# (n, k): a ragged last 16-column group and 32-column panel, an odd k (a half pair at the end).
@pytest.mark.parametrize(("n", "k"), [(50, 200), (37, 201)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(n: int, k: int) -> None:
    torch.manual_seed(0)
    x, w, bias = torch.randn(70, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    full = bf16_gemm.bf16_linear(x, w, bias, float_out=True)
    # Up to 8 rows take the streamed path (weights transposed on the fly), more the packed tiles:
    # a row alone or among a few must match the same row in the 70-row product.
    for start, rows in [(0, 1), (5, 2), (3, 7), (0, 8), (62, 8), (9, 9), (1, 13), (20, 33), (0, 70)]:
        assert torch.equal(
            bf16_gemm.bf16_linear(x[start : start + rows], w, bias, True), full[start : start + rows]
        )
    # Strided rows (a view of a wider activation) and another thread count.
    wide = torch.cat([x, torch.randn(70, 24).bfloat16()], dim=1)[:, :k]
    assert torch.equal(bf16_gemm.bf16_linear(wide, w, bias, True), full)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(bf16_gemm.bf16_linear(x, w, bias, True), full)
    finally:
        torch.set_num_threads(threads)


def test_rows_past_one_block_match_rows_alone() -> None:
    # More rows than one work item's block (BLOCK_ROWS): the blocks split the rows, never a chain.
    torch.manual_seed(2)
    x, w = torch.randn(1100, 40).bfloat16(), torch.randn(40, 40).bfloat16()
    full = bf16_gemm.bf16_linear(x, w, None, True)
    for start, rows in [(0, 1), (511, 1), (512, 1), (1099, 1), (500, 30), (1090, 10)]:
        assert torch.equal(
            bf16_gemm.bf16_linear(x[start : start + rows], w, None, True), full[start : start + rows]
        )


def test_serves_only_bfloat16_cpu_tensors() -> None:
    x, w = torch.randn(3, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    assert bf16_gemm.serves(x, w) and bf16_gemm.serves(x, w, torch.zeros(4).bfloat16())
    assert not bf16_gemm.serves(x.float(), w.float())
    assert not bf16_gemm.serves(x, w.t().contiguous().t())  # a transposed (non-contiguous) weight
    assert not bf16_gemm.serves(x[None], w)


def test_bfloat16_logits_are_float32_products_and_row_invariant() -> None:
    torch.manual_seed(1)
    head = ParallelLMHead(300, 64).to(torch.bfloat16)
    head.weight.data.normal_()
    hidden = torch.randn(6, 64).bfloat16()
    logits = LogitsProcessor()(head, hidden)
    assert logits.dtype == torch.float32
    # Not rounded to bfloat16 first (where near-ties would become ties).
    assert not torch.equal(logits, logits.bfloat16().float())
    assert torch.equal(logits, bf16_gemm.bf16_linear(hidden, head.weight, None, True))
    assert torch.equal(LogitsProcessor()(head, hidden[2:3]), logits[2:3])
    with torch.no_grad():
        compiled = torch.compile(LogitsProcessor(), fullgraph=True)
        assert torch.equal(compiled(head, hidden[4:5]), logits[4:5])
