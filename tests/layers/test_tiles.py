"""The shared tiled product (`tiles.tiled_product`): exact against one GEMM in the tiles' dtype, for any
number of tiles and a last partial tile, in the activations' dtype, and the widened scratch bounded by
`TILE_BYTES` and reused for every tile; bf16 tiles only for bf16 activations on a CPU with native bf16
dot products."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.quant import tiles


@pytest.mark.parametrize("tile_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_matches_one_gemm_and_bounds_the_scratch(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, tile_dtype: torch.dtype
) -> None:
    k, n = 96, 50
    size = tile_dtype.itemsize
    monkeypatch.setattr(tiles, "TILE_BYTES", size * k * 16)  # 16 rows a tile: 3 full tiles and a 2-row one
    weight = torch.randn(n, k)
    x = torch.randn(5, k).to(dtype)
    seen: list[tuple[slice, torch.Tensor]] = []

    def widen(rows: slice, tile: torch.Tensor) -> None:
        assert tile.dtype == tile_dtype and tile.numel() * size <= tiles.TILE_BYTES
        seen.append((rows, tile))
        tile.copy_(weight[rows])

    out = tiles.tiled_product(x, n, widen, tile_dtype)
    assert out.dtype == dtype and out.shape == (5, n)
    # The GEMM of the tiles' dtype (float32 or bf16 operands), rounded once to the activations' dtype
    expected = (x.to(tile_dtype) @ weight.to(tile_dtype).t()).to(dtype)
    torch.testing.assert_close(out, expected)
    assert [(r.start, r.stop) for r, _ in seen] == [(0, 16), (16, 32), (32, 48), (48, 50)]
    assert len({t.data_ptr() for _, t in seen}) == 1  # one buffer, reused


def test_tile_rows_fit_the_bound() -> None:
    assert tiles.tile_rows(576) * 576 * 4 <= tiles.TILE_BYTES < (tiles.tile_rows(576) + 1) * 576 * 4
    assert tiles.tile_rows(576, 2) * 576 * 2 <= tiles.TILE_BYTES < (tiles.tile_rows(576, 2) + 1) * 576 * 2
    assert tiles.tile_rows(tiles.TILE_BYTES) == 1  # rows wider than the bound: one a tile


@pytest.mark.parametrize("native", [True, False])
def test_gemm_dtype_is_bf16_only_for_bf16_activations_on_native_bf16(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    monkeypatch.setattr(tiles.CpuPlatform, "has_native_bf16", classmethod(lambda cls: native))
    assert tiles.gemm_dtype(torch.bfloat16) == (torch.bfloat16 if native else torch.float32)
    assert tiles.gemm_dtype(torch.float32) == torch.float32
