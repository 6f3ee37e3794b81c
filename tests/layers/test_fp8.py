"""Online fp8 weights: the per-output-channel e4m3 rounding and the tiled product against a plain
torch dequantize + matmul."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.quant import fp8, tiles
from pagedllm.layers.quant.fp8 import FP8, fp8_linear, quantize_rows
from pagedllm.layers.quant.tiles import tile_rows


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of 64 KB: weights of a few tiles stay small."""
    monkeypatch.setattr(tiles, "TILE_BYTES", 64 << 10)


def test_rows_keep_e4m3_precision_with_one_scale_each() -> None:
    weight = torch.randn(tile_rows(96) + 40, 96) * torch.logspace(-3, 1, tile_rows(96) + 40)[:, None]
    q, scale = quantize_rows(weight.bfloat16())
    assert q.dtype == FP8 and scale.shape == (weight.shape[0],)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((weight.shape[0],), 448.0))  # each row's max
    dequantized = q.float() * scale[:, None]
    reference = weight.bfloat16().float()
    # e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself; values
    # below e4m3's smallest normal (2^-6 of the scale unit) by at most half its subnormal step 2^-10.
    bound = torch.maximum(reference.abs() / 16, scale[:, None] * 2.0**-10)
    assert bool(((dequantized - reference).abs() <= bound * 1.0001).all())


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_matches_dequantized_matmul(rows: int, dtype: torch.dtype) -> None:
    q, scale = quantize_rows(torch.randn(2 * tile_rows(128) + 8, 128))
    x = torch.randn(rows, 128).to(dtype)
    out = fp8_linear(x, q, scale)
    assert out.dtype == dtype and out.shape == (rows, q.shape[0])
    expected = x.float() @ (q.float() * scale[:, None]).t()
    tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 5e-2}
    torch.testing.assert_close(out.float(), expected, **tolerance)


def test_without_the_kernel_torch_widens_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    q, scale = quantize_rows(torch.randn(tile_rows(64) + 8, 64))
    x = torch.randn(3, 64)
    assert fp8.library() is not None
    with_kernel = fp8_linear(x, q, scale)
    monkeypatch.setattr(fp8, "library", lambda: None)
    assert torch.equal(fp8_linear(x, q, scale), with_kernel)
