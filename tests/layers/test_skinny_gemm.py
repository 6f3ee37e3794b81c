"""The few-row product kernel against torch's `F.linear` (float64 reference), its row independence
(a row's result is bitwise the same alone or beside others: verification scores what one-token steps
score), also in its AVX2 and portable builds, and `linear`'s routing to it, eager and inside graphs
traced with a dynamic row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_builds import FORCED_SETS, forced_flag_set

from pagedllm.layers import skinny_gemm
from pagedllm.layers.linear import linear

pytestmark = pytest.mark.skipif(not skinny_gemm.available(), reason="no C compiler for the kernel")

# bfloat16: the kernel sums in float and rounds once, as torch does; the two differ by the order of
# the sums, within a couple of bfloat16 units of the largest outputs.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8])
# k = 576 is a multiple of the 16-lane chunks; 100 leaves a tail of 4; 7 has only the tail.
@pytest.mark.parametrize(("k", "n"), [(576, 96), (100, 33), (7, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_torch(dtype: torch.dtype, rows: int, k: int, n: int, with_bias: bool) -> None:
    torch.manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    bias = torch.randn(n).to(dtype) if with_bias else None
    assert skinny_gemm.serves(x, w, bias)
    got = skinny_gemm.skinny_linear(x, w, bias)
    want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert got.dtype == dtype and got.shape == (rows, n)
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("flag_set", FORCED_SETS)
def test_forced_builds_match_torch(flag_set: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with forced_flag_set(monkeypatch, flag_set):
        for dtype in (torch.float32, torch.bfloat16):
            for k, n in ((100, 33), (7, 5)):
                test_matches_torch(dtype, 5, k, n, True)
            test_rows_are_independent(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_independent(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 200).to(dtype)
    w = torch.randn(70, 200).to(dtype)
    together = skinny_gemm.skinny_linear(x, w)
    for rows in (2, 3, 5):
        assert torch.equal(skinny_gemm.skinny_linear(x[:rows], w), together[:rows])
    # Each row alone (two copies of it: the kernel takes 2 rows and up).
    for i in range(8):
        assert torch.equal(skinny_gemm.skinny_linear(x[[i, i]], w)[0], together[i])


def test_strided_input_rows() -> None:
    """A view of every other row of a wider tensor (the logits rows of a batch)."""
    x = torch.randn(4, 2, 64)[:, 0]
    w = torch.randn(10, 64)
    torch.testing.assert_close(skinny_gemm.skinny_linear(x, w), F.linear(x, w))


def test_serves_only_few_rows_of_matching_dtypes() -> None:
    w = torch.randn(10, 64)
    assert not skinny_gemm.serves(torch.randn(1, 64), w, None)
    assert not skinny_gemm.serves(torch.randn(skinny_gemm.MAX_ROWS + 1, 64), w, None)
    assert not skinny_gemm.serves(torch.randn(3, 64, dtype=torch.bfloat16), w, None)
    assert not skinny_gemm.serves(torch.randn(3, 64), w.t().contiguous().t(), None)
    assert not skinny_gemm.serves(torch.randn(2, 3, 64), w, None)


def _traced_ops(rows: int, low: int, high: int) -> list[str]:
    """The call targets of the graph Dynamo traces for `linear` on `rows` rows marked dynamic in
    [low, high]."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    x, w = torch.randn(rows, 64), torch.randn(10, 64)
    torch._dynamo.mark_dynamic(x, 0, min=low, max=high)
    out = torch.compile(linear, backend=backend)(x, w)
    torch.testing.assert_close(out, F.linear(x, w))
    return [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]


def test_compiled_graph_picks_the_kernel_only_where_the_range_proves_it() -> None:
    assert "pagedllm.skinny_linear" in _traced_ops(5, 2, skinny_gemm.MAX_ROWS)
    # A range reaching past the kernel's rows keeps torch's product (no guard splits the range).
    assert "pagedllm.skinny_linear" not in _traced_ops(5, 2, 64)
    assert "pagedllm.skinny_linear" not in _traced_ops(20, skinny_gemm.MAX_ROWS + 1, 64)


def test_linear_leaves_products_to_an_active_function_mode() -> None:
    """The batch-invariant mode pads every `F.linear`; a few-row product must reach it too."""
    seen: list[int] = []

    class Recording(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is F.linear:
                seen.append(args[0].shape[0])
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(3, 64), torch.randn(10, 64)
    with Recording():
        linear(x, w)
    assert seen == [3]
