"""The 4-bit group-quantized weight kernels (kernels/cpu/int4_kernels.c): the int4 kernel library
(`pagedllm.kernels.build`), loaded with ctypes.

`matmul` is the decode product (float32 activations, nibbles widened in registers); `dequantize_rows`
widens rows of the weight to float32/bfloat16 (the batched path's tiles); `matvec_entry` is the
native decode path's one-row product. The weight is the layout
int4_kernels.c describes, as `Int4Weight` holds it. Without a compiler an AWQ/GPTQ model cannot run:
`library()` raises.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from pagedllm.kernels import build
from pagedllm.kernels.abi import Int4Matvec
from pagedllm.layers.quant import base

_ISA_NAMES = {0: "portable C", 1: "AVX2"}


class Int4Weight(NamedTuple):
    """A weight [n, k] in the kernels' layout: `qweight` uint8 [n, k/2] (32-element chunks of 16 bytes,
    low nibbles the first 16 elements), `scales` float16 [n, k/group], `zeros` uint8 [n, k/group]."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group: int


@functools.cache
def library() -> ctypes.CDLL:
    loaded = build.load(build.INT4)
    if loaded is None:
        raise RuntimeError("the AWQ/GPTQ kernels could not be built (the warning logged before says why)")
    lib = loaded.cdll
    weight = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3  # q, s, z, n, k, group
    lib.int4_matmul.argtypes = [*weight, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    lib.int4_matmul.restype = ctypes.c_int
    lib.int4_dequantize_rows.argtypes = [*weight, ctypes.c_void_p, ctypes.c_int]
    lib.int4_dequantize_rows.restype = ctypes.c_int
    lib.int4_kernel_isa.restype = ctypes.c_int
    return lib


def isa() -> str:
    """The vector path the kernels were built with here."""
    return _ISA_NAMES[library().int4_kernel_isa()]


def _weight_args(w: Int4Weight, rows: int) -> tuple[int, ...]:
    k = w.qweight.shape[1] * 2
    return (w.qweight.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr(), rows, k, w.group)


def matmul(x: torch.Tensor, w: Int4Weight, out: torch.Tensor) -> None:
    """`out = x @ W^T` for contiguous float32 `x` [M, k] into float32 `out` [M, n] (unit column stride)."""
    if x.dtype != torch.float32 or out.dtype != torch.float32 or not x.is_contiguous() or out.stride(1) != 1:
        raise TypeError("int4 matmul takes contiguous float32 rows")
    n = w.qweight.shape[0]
    status = library().int4_matmul(
        *_weight_args(w, n), x.data_ptr(), x.shape[0], out.data_ptr(), out.stride(0)
    )
    if status != 0:
        raise ValueError(f"group size {w.group} must be a multiple of 32 dividing the width {x.shape[1]}")


def dequantize_rows(w: Int4Weight, out: torch.Tensor) -> None:
    """The first `out.shape[0]` rows of `w` (a row slice of the weight) into contiguous float32 or
    bfloat16 `out` [rows, k]."""
    if out.dtype not in (torch.float32, torch.bfloat16) or not out.is_contiguous():
        raise TypeError(f"int4 rows dequantize into contiguous float32 or bfloat16, not {out.dtype}")
    status = library().int4_dequantize_rows(
        *_weight_args(w, out.shape[0]), out.data_ptr(), out.dtype == torch.bfloat16
    )
    if status != 0:
        raise ValueError(f"group size {w.group} must be a multiple of 32 dividing the width {out.shape[1]}")


def matvec_entry(w: Int4Weight, perm: torch.Tensor | None) -> base.NativeMatvec:
    """The native one-row product (`int4_matvec`) of `w`, its input gathered by `perm` (int64, the
    act-order permutation) first, as `int4.int4_linear` computes it for one row."""
    if perm is not None and (perm.dtype != torch.int64 or not perm.is_contiguous()):
        raise TypeError(f"the act-order permutation must be contiguous int64, not {perm.dtype}")
    n = w.qweight.shape[0]
    desc = Int4Matvec(*_weight_args(w, n), perm.data_ptr() if perm is not None else None)
    return base.matvec_entry(library(), "int4_matvec", desc, w, perm)
