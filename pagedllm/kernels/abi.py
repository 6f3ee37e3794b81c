"""The C structs that Python fills for the native kernels, mirrored as ctypes structures, and their
check at load: each library exports `<name>_size()` for every struct it takes (`EXPORT_SIZE` in
include/common.h), and `check` refuses a library whose struct size differs from its mirror's. A field
added on one side only would otherwise shift every field after it: the C code reads garbage
addresses, a crash or silently wrong numbers instead of an error.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable


class KernelABIError(RuntimeError):
    """A loaded kernel library and its ctypes mirrors disagree about a struct."""


class StepArgs(ctypes.Structure):
    """`StepArgs` in cpu/attention.h: a step's decode rows, the same for every layer."""

    _fields_ = [
        ("tables", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("q_rows", ctypes.c_void_p),
        ("table_rows", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("num_reqs", ctypes.c_int64),
        ("slots", ctypes.c_void_p),
        ("num_slots", ctypes.c_int64),
    ]


class LayerArgs(ctypes.Structure):
    """`LayerArgs` in cpu/attention.h: a head layout's constants."""

    _fields_ = [
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_size", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("v_offset", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("window", ctypes.c_int64),
        ("soft_cap", ctypes.c_float),
        ("cache_type", ctypes.c_int64),
    ]


class LlamaLayer(ctypes.Structure):
    """`LlamaLayer` in cpu/llama_decode.c: one decoder layer's tensors and quantized products."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            *("input_norm", "qkv", "o", "post_norm", "gate_up", "down", "kv_cache"),
            *("qkv_bias", "o_bias", "gate_up_bias", "down_bias", "q_norm", "k_norm"),
        )
    ] + [("fns", ctypes.c_void_p * 4), ("descs", ctypes.c_void_p * 4)]


class LlamaModel(ctypes.Structure):
    """`LlamaModel` in cpu/llama_decode.c: the model's shapes, ends and layer table."""

    _fields_ = [
        *[
            (name, ctypes.c_int64)
            for name in (
                "hidden",
                "intermediate",
                "num_heads",
                "num_kv_heads",
                "head_size",
                "num_layers",
                "vocab",
            )
        ],
        ("eps", ctypes.c_float),
        ("embedding", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("layers", ctypes.c_void_p),
    ]


class SegmentArgs(ctypes.Structure):
    """`SegmentArgs` in cpu/llama_decode.c: a whole step's requests as prompt-kernel segments."""

    _fields_ = [
        ("tables", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("segs", ctypes.c_void_p),
        ("num_segs", ctypes.c_int64),
        ("slots", ctypes.c_void_p),
        ("num_slots", ctypes.c_int64),
    ]


class GGUFMatvec(ctypes.Structure):
    """`GGUFMatvec` in cpu/gguf_kernels.c: a GGUF layer's shards for the one-row product."""

    _fields_ = [
        ("nshards", ctypes.c_int64),
        ("w", ctypes.c_void_p),
        ("types", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("k", ctypes.c_int64),
    ]


class Int4Matvec(ctypes.Structure):
    """`Int4Matvec` in cpu/int4_kernels.c: a 4-bit weight for the one-row product."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("q", "s", "z")),
        *((name, ctypes.c_int64) for name in ("n", "k", "group")),
        ("perm", ctypes.c_void_p),
    ]


class Fp8Matvec(ctypes.Structure):
    """`Fp8Matvec` in cpu/fp8_kernels.c: an fp8 weight for the one-row product."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("q", "scale", "table")),
        *((name, ctypes.c_int64) for name in ("n", "k")),
    ]


def check(lib: ctypes.CDLL, structs: Iterable[type[ctypes.Structure]]) -> None:
    """Raise KernelABIError unless `lib` exports `<name>_size()` for each struct and it equals the
    mirror's size."""
    for struct in structs:
        name = struct.__name__
        try:
            size_fn = getattr(lib, f"{name}_size")
        except AttributeError:
            raise KernelABIError(
                f"{lib._name} exports no {name}_size(): its sources do not define the struct "
                f"{name} that pagedllm.kernels.abi mirrors"
            ) from None
        size_fn.argtypes = []
        size_fn.restype = ctypes.c_int64
        c_size, py_size = size_fn(), ctypes.sizeof(struct)
        if c_size != py_size:
            raise KernelABIError(
                f"struct {name} is {c_size} bytes in {lib._name} but {py_size} bytes in its ctypes mirror "
                f"{struct.__module__}.{struct.__qualname__}: the C struct and the mirror in "
                "pagedllm/kernels/abi.py must list the same fields"
            )
