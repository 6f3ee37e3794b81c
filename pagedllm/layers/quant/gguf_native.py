"""The GGUF block kernels (kernels/cpu/gguf_kernels.c): the gguf kernel library (`pagedllm.kernels.build`),
loaded with ctypes.

`matmul` is the product of activations with the (row-concatenated) quantized shards of a layer, int8
dot products on quantized activations; `dequantize_rows` widens rows to float32/bfloat16 (the batched
path's tiles and the embedding's gather); `matvec_entry` is the native decode path's one-row product.
Without a compiler a GGUF model cannot run quantized: `library()` raises, naming the way back to the
dequantized weights.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from pagedllm.kernels import build
from pagedllm.kernels.abi import GGUFMatvec
from pagedllm.layers.quant import base

_ISA_NAMES = {0: "portable C", 1: "AVX2", 2: "AVX2 + AVX-512 VNNI"}
_FLOATS = (torch.float32, torch.bfloat16)


@functools.cache
def library() -> ctypes.CDLL:
    loaded = build.load(build.GGUF)
    if loaded is None:
        raise RuntimeError(
            "the GGUF kernels could not be built (the warning logged before says why); "
            "load the model with quantization=None to run it on dequantized weights"
        )
    lib = loaded.cdll
    lib.gguf_matmul.argtypes = [
        ctypes.c_int64,  # shards
        ctypes.c_void_p,  # their addresses
        ctypes.c_void_p,  # their types (int32)
        ctypes.c_void_p,  # their rows (int64)
        ctypes.c_int64,  # k
        ctypes.c_void_p,  # x
        ctypes.c_int64,  # x row stride
        ctypes.c_int,  # x is bfloat16
        ctypes.c_int64,  # rows of x
        ctypes.c_void_p,  # y
        ctypes.c_int64,  # y row stride
        ctypes.c_int,  # y is bfloat16
    ]
    lib.gguf_matmul.restype = ctypes.c_int
    lib.gguf_dequantize_rows.argtypes = [
        ctypes.c_int,  # type
        ctypes.c_void_p,  # weight
        ctypes.c_int64,  # its rows
        ctypes.c_int64,  # k
        ctypes.c_void_p,  # row ids (int64) or NULL
        ctypes.c_int64,  # rows
        ctypes.c_void_p,  # out
        ctypes.c_int,  # out is bfloat16
    ]
    lib.gguf_dequantize_rows.restype = ctypes.c_int
    lib.gguf_row_bytes.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.gguf_row_bytes.restype = ctypes.c_int64
    lib.gguf_kernel_isa.restype = ctypes.c_int
    return lib


def isa() -> str:
    """The vector path the kernels were built with here."""
    return _ISA_NAMES[library().gguf_kernel_isa()]


def _check_float(t: torch.Tensor, what: str) -> None:
    if t.dtype not in _FLOATS or t.device.type != "cpu":
        raise TypeError(f"{what} must be float32 or bfloat16 on the CPU, not {t.dtype} on {t.device}")


def matmul(
    x: torch.Tensor, shards: Sequence[torch.Tensor], types: Sequence[int], k: int, out: torch.Tensor
) -> None:
    """`out = x @ W^T` for 2-D `x` [M, k] (unit column stride) and `W` the row-concatenation of
    `shards` (uint8 [rows, row bytes] of the ggml `types`), written to `out` [M, sum rows]."""
    _check_float(x, "the input")
    _check_float(out, "the output")
    n = len(shards)
    addresses = (ctypes.c_void_p * n)(*(s.data_ptr() for s in shards))
    ctypes_types = (ctypes.c_int32 * n)(*types)
    rows = (ctypes.c_int64 * n)(*(s.shape[0] for s in shards))
    status = library().gguf_matmul(
        n,
        addresses,
        ctypes_types,
        rows,
        k,
        x.data_ptr(),
        x.stride(0),
        x.dtype == torch.bfloat16,
        x.shape[0],
        out.data_ptr(),
        out.stride(0),
        out.dtype == torch.bfloat16,
    )
    if status != 0:
        raise ValueError(f"GGUF types {list(types)} cannot multiply rows of {k} elements")


def dequantize_rows(
    weight: torch.Tensor, qtype: int, k: int, out: torch.Tensor, ids: torch.Tensor | None = None
) -> None:
    """Rows `ids` (int64, contiguous; all rows when None) of `weight` (uint8 [rows, row bytes] of
    ggml type `qtype`, k elements a row) dequantized into `out` (contiguous [len(ids), k])."""
    _check_float(out, "the output")
    n = out.shape[0]
    status = library().gguf_dequantize_rows(
        qtype,
        weight.data_ptr(),
        weight.shape[0],
        k,
        ids.data_ptr() if ids is not None else None,
        n,
        out.data_ptr(),
        out.dtype == torch.bfloat16,
    )
    if status == -2:
        raise IndexError(f"a row id is outside the {weight.shape[0]} rows (token id outside the vocabulary?)")
    if status != 0:
        raise ValueError(f"GGUF type {qtype} cannot hold rows of {k} elements")


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of a row of `k` elements of ggml type `qtype` (0: not whole blocks, or not a type served here)."""
    return int(library().gguf_row_bytes(qtype, k))


def matvec_entry(shards: Sequence[torch.Tensor], types: Sequence[int], k: int) -> base.NativeMatvec:
    """The native one-row product (`gguf_matvec`) of the row-concatenation of `shards`, as `matmul`
    computes it for one float32 row."""
    n = len(shards)
    addresses = (ctypes.c_void_p * n)(*(s.data_ptr() for s in shards))
    ctypes_types = (ctypes.c_int32 * n)(*types)
    rows = (ctypes.c_int64 * n)(*(s.shape[0] for s in shards))
    desc = GGUFMatvec(n, ctypes.addressof(addresses), ctypes.addressof(ctypes_types), ctypes.addressof(rows), k)
    return base.matvec_entry(library(), "gguf_matvec", desc, addresses, ctypes_types, rows, tuple(shards))
