"""The GGUF block kernels (kernels/cpu/gguf_kernels.c): the gguf kernel library (`pagedllm.kernels.build`),
loaded with ctypes.

`matmul` is the product of activations with the (row-concatenated) quantized shards of a layer, int8
dot products on quantized activations; `matmul_panels` the many-row product of bf16 activations
(kernels/cpu/gguf_panels.c: L2-resident panels of bf16 weights, AVX512-BF16 only, `has_panels`);
`dequantize_rows` widens rows to float32/bfloat16 (the batched
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
# The leading arguments of the products: a layer's shards, as `_shard_arrays` gives them, and k.
_SHARD_ARGS = [
    ctypes.c_int64,  # shards
    ctypes.c_void_p,  # their addresses
    ctypes.c_void_p,  # their types (int32)
    ctypes.c_void_p,  # their rows (int64)
    ctypes.c_int64,  # k
]
# Their trailing ones: the output.
_OUTPUT_ARGS = [
    ctypes.c_void_p,  # y
    ctypes.c_int64,  # y row stride
    ctypes.c_int,  # y is bfloat16
]


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
        *_SHARD_ARGS,
        ctypes.c_void_p,  # x
        ctypes.c_int64,  # x row stride
        ctypes.c_int,  # x is bfloat16
        ctypes.c_int64,  # rows of x
        *_OUTPUT_ARGS,
    ]
    lib.gguf_matmul.restype = ctypes.c_int
    lib.gguf_matmul_panels.argtypes = [
        *_SHARD_ARGS,
        ctypes.c_void_p,  # x (bfloat16)
        ctypes.c_int64,  # x row stride
        ctypes.c_int64,  # rows of x
        *_OUTPUT_ARGS,
    ]
    lib.gguf_matmul_panels.restype = ctypes.c_int
    lib.gguf_panels_available.restype = ctypes.c_int
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


def has_panels() -> bool:
    """Whether the kernels were built with the bf16 panel product (`matmul_panels`): AVX512-BF16."""
    return bool(library().gguf_panels_available())


def _shard_arrays(
    shards: Sequence[torch.Tensor], types: Sequence[int]
) -> tuple[int, ctypes.Array, ctypes.Array, ctypes.Array]:
    """(count, addresses, ggml types, rows) of a layer's shards as the kernels take them."""
    n = len(shards)
    addresses = (ctypes.c_void_p * n)(*(s.data_ptr() for s in shards))
    return n, addresses, (ctypes.c_int32 * n)(*types), (ctypes.c_int64 * n)(*(s.shape[0] for s in shards))


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
    n, addresses, ctypes_types, rows = _shard_arrays(shards, types)
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


def matmul_panels(
    x: torch.Tensor, shards: Sequence[torch.Tensor], types: Sequence[int], k: int, out: torch.Tensor
) -> None:
    """`matmul` for bfloat16 `x` [M, k] by bf16 panels of the weight (weights rounded to bf16, float32
    sums); only where `has_panels()`."""
    if x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise TypeError(f"the panel product takes bfloat16 rows with unit column stride, not {x.dtype}")
    _check_float(out, "the output")
    args = (x.data_ptr(), x.stride(0), x.shape[0], out.data_ptr(), out.stride(0), out.dtype == torch.bfloat16)
    status = library().gguf_matmul_panels(*_shard_arrays(shards, types), k, *args)
    if status == -3:
        raise RuntimeError("the GGUF kernels were built without AVX512-BF16: no panel product")
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
    n, addresses, ctypes_types, rows = _shard_arrays(shards, types)
    desc = GGUFMatvec(
        n, ctypes.addressof(addresses), ctypes.addressof(ctypes_types), ctypes.addressof(rows), k
    )
    return base.matvec_entry(library(), "gguf_matvec", desc, addresses, ctypes_types, rows, tuple(shards))
