"""The GGUF block kernels against gguf-py's reference dequantization: rows dequantized exactly, and the
int8-activation product within its rounding of the float product; the batched (dequantized tiles +
GEMM) path exact, its tiles spanning the parts of a fused layer; the AVX2 (no VNNI) and portable (no
AVX2) builds the same;
the op inside torch.compile; bad shapes refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from kernel_builds import FORCED_SETS, forced_flag_set

from pagedllm.layers.quant import gguf, gguf_native, tiles

BIT_EXACT_ONE_ROW = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16, Q.F32]
# (block bytes, offsets of the float16 scales) of the K-quants gguf-py cannot quantize.
_RANDOM_BLOCKS = {
    Q.Q2_K: (84, (80, 82)),
    Q.Q3_K: (110, (108,)),
    Q.Q4_K: (144, (0, 2)),
    Q.Q5_K: (176, (0, 2)),
    Q.Q6_K: (210, (208,)),
}
N, K = 48, 512


def _weight(qtype: Q, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [N, row bytes], its float32 dequantization by gguf-py)."""
    if qtype in _RANDOM_BLOCKS:
        size, offsets = _RANDOM_BLOCKS[qtype]
        raw = rng.integers(0, 256, size=(N, K // 256, size), dtype=np.uint8)
        for off in offsets:
            raw[..., off : off + 2] = (
                rng.uniform(1e-4, 1e-3, (N, K // 256, 1)).astype(np.float16).view(np.uint8)
            )
        raw = raw.reshape(N, -1)
    else:
        raw = quantize(rng.standard_normal((N, K)).astype(np.float32), qtype)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(N, -1)
    return torch.from_numpy(raw), torch.from_numpy(dequantize(raw, qtype).reshape(N, K).astype(np.float32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernels_match_gguf_reference(qtype: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    _check_kernels(qtype, monkeypatch)


def _check_kernels(qtype: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    packed, reference = _weight(qtype, np.random.default_rng(int(qtype)))
    rows = torch.empty(N, K)
    gguf_native.dequantize_rows(packed, int(qtype), K, rows)
    assert torch.equal(rows, reference)
    ids = torch.tensor([5, 0, 47, 5])
    gathered = torch.empty(4, K, dtype=torch.bfloat16)
    gguf_native.dequantize_rows(packed, int(qtype), K, gathered, ids)
    assert torch.equal(gathered, reference[ids].bfloat16())

    x = torch.randn(3, K, generator=torch.Generator().manual_seed(0))
    expected = x @ reference.T
    # Two shards of one weight, one kernel call: the int8 path (few rows).
    out = gguf.gguf_linear(x, [packed[:20], packed[20:]], [int(qtype)] * 2, N)
    scale = expected.abs().max()
    if qtype in (Q.F16, Q.BF16, Q.F32):
        torch.testing.assert_close(out, expected, atol=1e-4 * scale, rtol=0)
    else:
        # int8 activations: each element rounded to 1/254 of its block's largest; the sum of K such
        # errors is ~0.5% of the largest output for Gaussian inputs, never near 2%.
        assert (out - expected).abs().max() < 0.02 * scale
    # One activation row (decode): weight rows four at a time, row by row where four would cross the
    # parts' boundary (rows 16-19 here); the same products as the several-row path's. For the 32-element
    # block types of the vector build to the bit: the native decode body and the graphs (whose decode
    # batch may be padded to several rows) must agree exactly, or a last-bit difference flips an int8
    # activation rounding layers later. (The K-quants' two-term minimums and the portable loops are
    # left to the compiler's contraction: last-bit differences.)
    one = gguf.gguf_linear(x[:1], [packed[:18], packed[18:]], [int(qtype)] * 2, N)
    if qtype in BIT_EXACT_ONE_ROW and gguf_native.isa() != "portable C":
        assert torch.equal(one, out[:1]), (one - out[:1]).abs().max()
    else:
        torch.testing.assert_close(one, out[:1], atol=1e-5 * scale, rtol=0)
    # Many rows: dequantized tiles into the float GEMM, exact up to summation order. Tiles of 7 rows,
    # so that tiles span the parts' boundary (as a fused q/k/v layer's do); the layer's output is
    # then sliced by part, as the model splits it.
    monkeypatch.setattr(tiles, "TILE_BYTES", 7 * K * 4)
    xs = torch.randn(gguf.int8_max_rows([int(qtype)], panels=False) + 5, K, generator=torch.Generator().manual_seed(1))
    many = gguf.gguf_linear(xs, [packed[:20], packed[20:]], [int(qtype)] * 2, N)
    expected = xs @ reference.T
    for part in (slice(0, 20), slice(20, N)):
        torch.testing.assert_close(many[:, part], expected[:, part], atol=1e-4 * expected.abs().max(), rtol=0)


def _format_bound(x: torch.Tensor, weight: torch.Tensor, exact: torch.Tensor, int8: bool) -> torch.Tensor:
    """The largest error the layer's product of bf16 rows `x` with the dequantized `weight` may make
    for each output: the rounding of its path's inputs (int8 activations: each element off by at most
    half a step, its block's largest / 127 / 2; bf16 tiles: each weight rounded to bf16, 2^-9 of itself;
    float32 tiles: exact), float32 accumulation over K terms (K 2^-24 of the sum of magnitudes, with a
    factor 4 for the scale and minimum terms of the int8 path, each up to a few times a product), and
    the bf16 output's rounding (2^-9 of the value)."""
    xd, wd = x.double(), weight.double().abs()
    magnitude = xd.abs() @ wd.T
    if int8:
        half_step = xd.abs().reshape(x.shape[0], -1, 32).amax(-1) / 127 / 2
        inputs = half_step.repeat_interleave(32, dim=1) @ wd.T
    else:
        # bf16 weights where the panels or bf16 tiles take the product (gguf.takes_panels implies the latter)
        inputs = magnitude * (2.0**-9 if tiles.gemm_dtype(torch.bfloat16) == torch.bfloat16 else 0.0)
    return 1.01 * (inputs + 4 * K * 2.0**-24 * magnitude + 2.0**-9 * (exact.abs() + inputs))


@pytest.mark.parametrize("rows", [1, 4, 7, 64, 300])
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_bf16_product_at_every_row_count_within_the_format_bound(
    qtype: Q, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer's product of bf16 activations (the default dtype on AVX512-BF16 CPUs) at one row, a
    few (int8 kernel) and many (bf16 panels where the kernels have AVX512-BF16, else dequantized tiles:
    bf16 ones where the CPU has native bf16 dot products), against the float64 product of gguf-py's
    dequantization, within `_format_bound`. Tiles of 9 rows, so that they span the parts' boundary
    (rows 20-26)."""
    packed, reference = _weight(qtype, np.random.default_rng(int(qtype) + 100))
    monkeypatch.setattr(tiles, "TILE_BYTES", 9 * K * 4)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).bfloat16()
    out = gguf.gguf_linear(x, [packed[:20], packed[20:]], [int(qtype)] * 2, N)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, N)
    exact = x.double() @ reference.double().T
    int8 = rows <= gguf.int8_max_rows([int(qtype)], gguf.takes_panels(torch.bfloat16))
    bound = _format_bound(x, reference, exact, int8)
    error = (out.double() - exact).abs()
    assert (error <= bound).all(), f"{(error / bound).max():.3f} of the bound"


@pytest.mark.skipif(not gguf_native.has_panels(), reason="the kernels have no AVX512-BF16 panel product here")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16_out", "f32_out"])
def test_panel_product_within_the_bf16_weight_bound(rows: int, out_dtype: torch.dtype) -> None:
    """`matmul_panels` itself at every row count (row blocks of 6 and their remainders), over parts of
    Q4_0, Q8_0, Q4_K, Q6_K and F16 (176 weight rows: two full 64-row panels and a 48-row one whose
    columns beyond the weight are not written), into rows of a wider output (its row stride), against
    the float64 product of gguf-py's dequantization within the bf16-weight bound."""
    rng = np.random.default_rng(7)
    parts = [_weight(q, rng) for q in (Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K)]
    f16, f16_reference = _weight(Q.F16, rng)
    shards = [p for p, _ in parts] + [f16[:32]]
    types = [int(q) for q in (Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.F16)]
    reference = torch.cat([r for _, r in parts] + [f16_reference[:32]])
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).bfloat16()
    wide = torch.full((rows, reference.shape[0] + 5), 7.0, dtype=out_dtype)
    gguf_native.matmul_panels(x, shards, types, K, wide[:, : reference.shape[0]])
    assert (wide[:, reference.shape[0] :] == 7.0).all()
    exact = x.double() @ reference.double().T
    bound = _format_bound(x, reference, exact, int8=False)
    error = (wide[:, : reference.shape[0]].double() - exact).abs()
    assert (error <= bound).all(), f"{(error / bound).max():.3f} of the bound"


@pytest.mark.skipif(not gguf_native.has_panels(), reason="the kernels have no AVX512-BF16 panel product here")
def test_panel_product_of_a_row_is_the_same_at_any_row_count() -> None:
    """Each row's sums run in one order whatever the row count and the row's place in its row block
    (README, Reproducibility): rows 3-9 of a 300-row product equal the 7-row product, bitwise."""
    packed, _ = _weight(Q.Q4_K, np.random.default_rng(9))
    x = torch.randn(300, K, generator=torch.Generator().manual_seed(9)).bfloat16()
    many, few = torch.empty(300, N, dtype=torch.bfloat16), torch.empty(7, N, dtype=torch.bfloat16)
    gguf_native.matmul_panels(x, [packed], [int(Q.Q4_K)], K, many)
    gguf_native.matmul_panels(x[3:10], [packed], [int(Q.Q4_K)], K, few)
    assert torch.equal(many[3:10], few)


@pytest.mark.parametrize(("native", "panels", "amx", "expected"), [
    (True, True, False, True),  # AVX512-BF16 without AMX: the panel kernel
    (True, True, True, False),  # AMX: torch's bf16 GEMM of the dequantized tiles (oneDNN's tiles)
    (True, False, False, False),  # kernels built without AVX512-BF16 (a forced AVX2 build)
    (False, True, False, False),  # no native bf16: float32 tiles
])
def test_many_rows_take_panels_only_on_avx512_bf16_without_amx(
    monkeypatch: pytest.MonkeyPatch, native: bool, panels: bool, amx: bool, expected: bool
) -> None:
    monkeypatch.setattr(tiles.CpuPlatform, "has_native_bf16", classmethod(lambda cls: native))
    monkeypatch.setattr(gguf.CpuPlatform, "has_amx_bf16", classmethod(lambda cls: amx))
    monkeypatch.setattr(gguf_native, "has_panels", lambda: panels)
    assert gguf.takes_panels(torch.bfloat16) == expected
    assert not gguf.takes_panels(torch.float32)


@pytest.mark.parametrize("flag_set", FORCED_SETS)
def test_forced_builds_match(flag_set: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """gguf_kernels.c built for AVX2 without VNNI (its multiply-adds in two instructions) and as the
    loader builds it where no vector set compiles (no AVX2 or F16C on x86-64: the portable C path),
    every type against the same reference: only slower, never different."""
    with forced_flag_set(monkeypatch, flag_set):
        assert gguf_native.isa() == {"avx2": "AVX2", "portable": "portable C"}[flag_set]
        for qtype in TYPES:
            _check_kernels(qtype, monkeypatch)


def test_row_switch_takes_the_smallest_of_the_parts_types(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf, "_INT8_MAX_ROWS_BY_TYPE", {int(Q.Q4_1): 8, int(Q.Q6_K): 2})
    assert gguf.int8_max_rows([int(Q.Q4_1)], panels=False) == 8
    assert gguf.int8_max_rows([int(Q.Q4_1), int(Q.Q6_K)], panels=False) == 2
    assert gguf.int8_max_rows([int(Q.F16)], panels=False) == gguf.INT8_MAX_ROWS
    monkeypatch.setattr(gguf, "_PANELS_INT8_MAX_ROWS_BY_TYPE", {int(Q.Q8_0): 6, int(Q.Q6_K): 3})
    assert gguf.int8_max_rows([int(Q.Q8_0)], panels=True) == 6
    assert gguf.int8_max_rows([int(Q.Q8_0), int(Q.Q6_K)], panels=True) == 3
    assert gguf.int8_max_rows([int(Q.Q4_1)], panels=True) == gguf.PANELS_INT8_MAX_ROWS


def test_bfloat16_activations_and_mixed_shard_types() -> None:
    rng = np.random.default_rng(0)
    (a, ra), (b, rb) = _weight(Q.Q4_K, rng), _weight(Q.Q6_K, rng)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = gguf.gguf_linear(x, [a, b], [int(Q.Q4_K), int(Q.Q6_K)], 2 * N)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 2 * N)
    expected = x.float() @ torch.cat([ra, rb]).T
    assert (out.float() - expected).abs().max() < 0.02 * expected.abs().max()


def test_op_runs_inside_torch_compile() -> None:
    packed, reference = _weight(Q.Q4_1, np.random.default_rng(1))
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(3))

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.pagedllm.gguf_linear(x * 2, [w], [int(Q.Q4_1)], N).relu()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, packed), f(x, packed))


def test_bad_shapes_and_ids_are_refused() -> None:
    packed, _ = _weight(Q.Q4_0, np.random.default_rng(2))
    with pytest.raises(ValueError, match="cannot multiply rows of 100 elements"):
        gguf_native.matmul(torch.randn(1, 100), [packed], [int(Q.Q4_0)], 100, torch.empty(1, N))
    with pytest.raises(IndexError, match="outside the 48 rows"):
        gguf_native.dequantize_rows(packed, int(Q.Q4_0), K, torch.empty(1, K), torch.tensor([48]))
    assert gguf_native.isa() in ("portable C", "AVX2", "AVX2 + AVX-512 VNNI")
