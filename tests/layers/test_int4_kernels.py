"""The AWQ/GPTQ product (`int4_linear`: the native kernel for few rows, dequantized tiles + GEMM for
many) against a plain torch dequantize + matmul of weights packed as AutoAWQ and AutoGPTQ write them;
also its AVX2 and portable C builds whatever this machine has, which must be only slower, never
different."""

from __future__ import annotations

import pytest
import torch
from int4_checkpoints import act_order_g_idx, random_packed
from kernel_builds import FORCED_SETS, forced_flag_set

from pagedllm.layers.quant import int4_native
from pagedllm.layers.quant.int4 import MATMUL_MAX_ROWS, int4_linear
from pagedllm.layers.quant.int4_layouts import act_order_permutation, awq_to_int4, gptq_to_int4, pack_int4
from pagedllm.layers.quant.int4_native import Int4Weight

CASES = [
    ("awq", 32, False),
    ("awq", 128, False),
    ("gptq", 64, False),
    ("gptq", 32, True),
    ("gptq", 128, True),
]
# Rows: the kernel's single-row and several-row paths, and the tiled GEMM (a partial last tile too).
ROWS = [1, 3, MATMUL_MAX_ROWS + 1, 40]


def _layer(fmt: str, group: int, act_order: bool, out_features: int = 264, in_features: int = 256):
    """(the kernel's tensors, input permutation, dequantized reference W [out, in])."""
    gen = torch.Generator().manual_seed(1)
    g_idx = act_order_g_idx(in_features, group, gen) if act_order else None
    packed = random_packed(fmt, out_features, in_features, group, g_idx, gen)
    t = packed.tensors
    q, z, s = (awq_to_int4 if fmt == "awq" else gptq_to_int4)(t["qweight"], t["qzeros"], t["scales"])
    perm = act_order_permutation(t["g_idx"], group) if fmt == "gptq" else None
    assert (perm is not None) == act_order
    if perm is not None:
        q = q[:, perm]
    return (pack_int4(q), s, z.to(torch.uint8)), perm, packed.dequantized


@pytest.mark.parametrize(("fmt", "group", "act_order"), CASES)
@pytest.mark.parametrize("rows", ROWS)
def test_product_matches_dequantized_matmul(fmt: str, group: int, act_order: bool, rows: int) -> None:
    weight, perm, reference = _layer(fmt, group, act_order)
    x = torch.randn(rows, reference.shape[1], generator=torch.Generator().manual_seed(rows))
    expected = x @ reference.t()
    out = int4_linear(x, *weight, perm, group)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    # float32 both ways: only the summation order differs (outputs of magnitude ~5).
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    x16 = x.bfloat16()
    out16 = int4_linear(x16, *weight, perm, group)
    assert out16.dtype == torch.bfloat16
    # bfloat16 activations are widened exactly; the output is rounded to bfloat16 (8 bits).
    torch.testing.assert_close(out16.float(), x16.float() @ reference.t(), rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("flag_set", FORCED_SETS)
def test_forced_builds_match(flag_set: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """int4_kernels.c built for AVX2 + FMA and without vector extensions (the portable C path)."""
    with forced_flag_set(monkeypatch, flag_set):
        assert int4_native.isa() == {"avx2": "AVX2", "portable": "portable C"}[flag_set]
        for fmt, group, act_order in CASES[::2]:
            weight, perm, reference = _layer(fmt, group, act_order)
            for rows in (1, 3):
                x = torch.randn(rows, reference.shape[1])
                torch.testing.assert_close(
                    int4_linear(x, *weight, perm, group), x @ reference.t(), rtol=1e-5, atol=1e-4
                )
            tile = torch.empty(reference.shape)
            int4_native.dequantize_rows(Int4Weight(*weight, group), tile)
            reordered = reference if perm is None else reference[:, perm]
            torch.testing.assert_close(tile, reordered, rtol=1e-6, atol=1e-6)


def test_bad_group_is_refused() -> None:
    weight, _, reference = _layer("awq", 32, False)
    with pytest.raises(ValueError, match="group size 48"):
        int4_native.matmul(torch.randn(1, 256), Int4Weight(*weight, 48), torch.empty(1, reference.shape[0]))


def test_act_order_g_idx_must_fill_groups() -> None:
    g_idx = torch.arange(64) // 32
    g_idx[0] = 1  # group 1 has 33 columns
    with pytest.raises(ValueError, match="does not assign 32 input columns"):
        act_order_permutation(g_idx, 32)
    assert act_order_permutation(torch.arange(64) // 32, 32) is None  # in order: no permutation
