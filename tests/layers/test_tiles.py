"""The shared tiled product (`tiles.tiled_product`): exact against one float GEMM, for any number of
tiles and a last partial tile, in the activations' dtype, and the widened scratch bounded by
`TILE_BYTES` and reused for every tile."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.quant import tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_matches_one_gemm_and_bounds_the_scratch(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    k, n = 96, 50
    monkeypatch.setattr(tiles, "TILE_BYTES", 4 * k * 16)  # 16 rows a tile: 3 full tiles and a 2-row one
    weight = torch.randn(n, k)
    x = torch.randn(5, k).to(dtype)
    seen: list[tuple[slice, torch.Tensor]] = []

    def widen(rows: slice, tile: torch.Tensor) -> None:
        assert tile.dtype == torch.float32 and tile.numel() * 4 <= tiles.TILE_BYTES
        seen.append((rows, tile))
        tile.copy_(weight[rows])

    out = tiles.tiled_product(x, n, widen)
    assert out.dtype == dtype and out.shape == (5, n)
    # float32 products, rounded once to the activations' dtype
    torch.testing.assert_close(out, (x.float() @ weight.t()).to(dtype))
    assert [(r.start, r.stop) for r, _ in seen] == [(0, 16), (16, 32), (32, 48), (48, 50)]
    assert len({t.data_ptr() for _, t in seen}) == 1  # one buffer, reused


def test_tile_rows_fit_the_bound() -> None:
    assert tiles.tile_rows(576) * 576 * 4 <= tiles.TILE_BYTES < (tiles.tile_rows(576) + 1) * 576 * 4
    assert tiles.tile_rows(tiles.TILE_BYTES) == 1  # rows wider than the bound: one a tile
