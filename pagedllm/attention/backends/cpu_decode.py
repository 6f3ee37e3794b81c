"""The native CPU paged-attention kernels (kernels/cpu/attention_decode.c, attention_prefill.c):
bindings to the dense kernel library (`pagedllm.kernels.build`).

Decode attention in tensor ops must first gather every request's key and value blocks into a batch
(a bandwidth-bound copy of everything attended to, then read again by small batched GEMMs); the
decode kernel reads the blocks where they lie, once, with the query heads of a group and the rows of
a request (the tokens verifying its drafts) sharing each read. The prompt kernel (bfloat16) does the
same for prompt segments, a flash attention whose scores and value sums are both `vdpbf16ps`
products: torch's CPU flash-attention kernel computes bfloat16 in float32 at a fraction of the
bfloat16 GEMM rate.
Without a working compiler `kernel()` is None and the backend keeps its tensor-op paths.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pagedllm.attention import fp8_kv
from pagedllm.kernels import build
from pagedllm.kernels.abi import LayerArgs, StepArgs

# Kernels by the activations' dtype; the cache holds that dtype or fp8 (`_CACHE_TYPES`, vec.h's enum).
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_CACHE_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}

_DECODE_ARGTYPES = [
    ctypes.c_void_p,  # q
    ctypes.c_int64,  # q row stride
    ctypes.c_void_p,  # key (this step's new rows)
    ctypes.c_int64,  # key row stride
    ctypes.c_void_p,  # value
    ctypes.c_int64,  # value row stride
    ctypes.c_void_p,  # the layer's cache
    ctypes.c_void_p,  # its float32 [k_scale, v_scale] (NULL: 1)
    ctypes.c_void_p,  # out
    ctypes.c_int64,  # out row stride
    ctypes.POINTER(StepArgs),
    ctypes.POINTER(LayerArgs),
]
_WRITE_ARGTYPES = [
    ctypes.c_void_p,  # key
    ctypes.c_int64,  # key row stride
    ctypes.c_void_p,  # value
    ctypes.c_int64,  # value row stride
    ctypes.c_void_p,  # k cache
    ctypes.c_void_p,  # v cache
    ctypes.c_void_p,  # slot of each token
    ctypes.c_int64,  # tokens
    ctypes.c_int64,  # kv heads
    ctypes.c_int64,  # block size
    ctypes.c_int64,  # head size
    ctypes.c_int64,  # cache type
    ctypes.c_void_p,  # float32 [k_scale, v_scale] (NULL: 1)
]
_PREFILL_ARGTYPES = [
    ctypes.c_void_p,  # q
    ctypes.c_int64,  # q row stride
    ctypes.c_void_p,  # the layer's cache
    ctypes.c_void_p,  # out
    ctypes.c_int64,  # out row stride
    ctypes.c_void_p,  # block tables
    ctypes.c_int64,  # block-table row stride
    ctypes.c_void_p,  # segments: (first row, rows, cached tokens, block-table row) each
    ctypes.c_int64,  # segments
    ctypes.POINTER(LayerArgs),
]
# The C kernel's fixed per-thread buffers (MAX_GROUP, MAX_HEAD) and its widest vector (LANES floats,
# AVX-512; 8 on other CPUs): head sizes and the prompt kernel's block sizes are multiples of it.
MAX_GROUP, MAX_HEAD, LANES = 16, 256, 16
# Query vectors per work item of the prompt kernel (TILE_M): a group's heads must fit in one.
PREFILL_TILE = 48


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it cannot be built (logged once)."""
    lib = build.cdll(build.DENSE)
    if lib is None:
        return None
    for suffix in _SUFFIXES.values():
        getattr(lib, f"decode_layer_{suffix}").argtypes = _DECODE_ARGTYPES
        getattr(lib, f"decode_layer_{suffix}").restype = ctypes.c_int
        getattr(lib, f"write_kv_{suffix}").argtypes = _WRITE_ARGTYPES
        getattr(lib, f"write_kv_{suffix}").restype = ctypes.c_int
    lib.prefill_layer_bf16.argtypes = _PREFILL_ARGTYPES
    lib.prefill_layer_bf16.restype = ctypes.c_int
    lib.prefill_supported.restype = ctypes.c_int
    return lib


def supports(dtype: torch.dtype, kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> bool:
    """Whether the kernels can serve a layer of this head layout whose activations are `dtype` and
    whose cache is `kv_cache`: a contiguous CPU cache of the activations' dtype or of fp8 (e4m3 or
    e5m2), one the kernels take. (Query, key and value rows must hold their heads contiguously: the
    attention layer's views of the fused projection do.) The prompt kernel serves fewer
    (`DecodeLayout.prefill_fn`)."""
    _, _, _, _, head_size = kv_cache.shape
    return (
        kv_cache.device.type == "cpu"
        and (kv_cache.dtype == dtype or fp8_kv.is_fp8(kv_cache.dtype))
        and dtype in _SUFFIXES
        and kv_cache.is_contiguous()
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_size <= MAX_HEAD
        and head_size % LANES == 0
        and kernel() is not None
    )


class DecodeStep:
    """A step's decode rows as the kernel takes them, converted once for every layer: the step's
    block tables (int32, contiguous rows) and, per decode row, its query row, block-table row and
    length (int64). A request with several new tokens (draft verification) has one row per token,
    each as long as its position + 1, sharing the request's block-table row. With `slots` (int64: the
    cache slot of each of the step's new tokens) each layer's call also stores the new keys and values
    first; leave it None when they were stored already."""

    def __init__(
        self,
        block_tables: torch.Tensor,
        q_rows: torch.Tensor,
        table_rows: torch.Tensor,
        seq_lens: torch.Tensor,
        slots: torch.Tensor | None,
    ) -> None:
        if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
            raise ValueError("block_tables must be int32 with contiguous rows")
        # The structure holds raw addresses: these references keep the tensors alive with it.
        self.tensors = (block_tables, q_rows, table_rows, seq_lens, slots)
        self.args = StepArgs(
            block_tables.data_ptr(),
            block_tables.stride(0),
            q_rows.data_ptr(),
            table_rows.data_ptr(),
            seq_lens.data_ptr(),
            q_rows.shape[0],
            slots.data_ptr() if slots is not None else None,
            slots.shape[0] if slots is not None else 0,
        )
        self.pointer = ctypes.pointer(self.args)

    @property
    def stores_kv(self) -> bool:
        """Whether each layer's call stores the step's new keys and values."""
        return self.args.num_slots > 0


class DecodeLayout:
    """A head layout's constants as the kernel takes them (with the sliding window, the logits soft
    cap, 0 for none, and the cache's element type), and the kernel of its activations' `dtype`
    (the cache's unless given: an fp8 cache serves float32 or bfloat16 activations); the same for
    every layer with that layout and cache shape (check `supports` first)."""

    def __init__(
        self,
        num_heads: int,
        kv_cache: torch.Tensor,
        scale: float,
        window: int,
        soft_cap: float = 0.0,
        dtype: torch.dtype | None = None,
    ) -> None:
        _, _, num_kv_heads, block_size, head_size = kv_cache.shape
        self.dtype = dtype or kv_cache.dtype
        self.args = LayerArgs(
            num_heads,
            num_kv_heads,
            head_size,
            block_size,
            kv_cache.stride(0),
            scale,
            window,
            soft_cap,
            _CACHE_TYPES[kv_cache.dtype],
        )
        self.pointer = ctypes.pointer(self.args)
        lib = kernel()
        self.fn = getattr(lib, f"decode_layer_{_SUFFIXES[self.dtype]}")
        serves = prompt_kernel_serves(head_size, num_heads // num_kv_heads, block_size, kv_cache.dtype)
        self.prefill_fn = lib.prefill_layer_bf16 if serves else None


def prompt_kernel_serves(
    head_size: int, group: int, block_size: int = LANES, cache_dtype: torch.dtype = torch.bfloat16
) -> bool:
    """Whether the prompt kernel (cpu_prefill.c) serves a layout: a bfloat16 cache on an AVX512-BF16
    CPU, head pairs in whole vectors, 16-key chunks within a block, a group's heads within one tile."""
    lib = kernel()
    return (
        lib is not None
        and cache_dtype == torch.bfloat16
        and bool(lib.prefill_supported())
        and head_size % 32 == 0
        and block_size % LANES == 0
        and group <= PREFILL_TILE
    )


def decode_layer(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scales: torch.Tensor | None,
    out: torch.Tensor,
    step: DecodeStep,
    layout: DecodeLayout,
) -> None:
    """One layer's decode attention: stores the step's new `key`/`value` rows at its slots (if the
    step has them), then writes `out[q_rows[i]]`, the attention of `query[q_rows[i]]` [heads,
    head_size] over the first `seq_lens[i]` keys (the last `window`, if > 0) of decode row i. An fp8
    cache's elements are stored as x / scale and read as fp8 * scale, with `kv_scales` the layer's
    contiguous float32 [k_scale, v_scale] (None: 1)."""
    status = layout.fn(
        query.data_ptr(),
        query.stride(0),
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        kv_cache.data_ptr(),
        _scales_pointer(kv_scales),
        out.data_ptr(),
        out.stride(0),
        step.pointer,
        layout.pointer,
    )
    if status != 0:
        raise RuntimeError("native decode kernel rejected its shapes (check supports() first)")


class PrefillStep:
    """A step's prompt segments as the prompt kernel takes them, built once for every layer: per
    segment its first query row, its number of rows, its cached tokens before them and its
    block-table row (int64 [segments, 4]), and the step's block tables (int32, contiguous rows)."""

    def __init__(self, block_tables: torch.Tensor, segments: torch.Tensor) -> None:
        if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
            raise ValueError("block_tables must be int32 with contiguous rows")
        if segments.dtype != torch.int64 or segments.dim() != 2 or segments.shape[1] != 4:
            raise ValueError("segments must be int64 [n, 4]")
        self.block_tables, self.segments = block_tables, segments.contiguous()


def prefill_layer(
    query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, step: PrefillStep, layout: DecodeLayout
) -> None:
    """Causal attention of each prompt segment's query rows over its keys in `kv_cache` (stored
    there already: the cached prefix and the segment's own), written to the same rows of `out`
    ([tokens, heads, head_size], heads contiguous); the layout must serve prompts (`prefill_fn`)."""
    assert layout.prefill_fn is not None
    status = layout.prefill_fn(
        query.data_ptr(),
        query.stride(0),
        kv_cache.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        step.block_tables.data_ptr(),
        step.block_tables.stride(0),
        step.segments.data_ptr(),
        step.segments.shape[0],
        layout.pointer,
    )
    if status != 0:
        raise RuntimeError("native prompt-attention kernel rejected its shapes")


def _scales_pointer(kv_scales: torch.Tensor | None) -> int | None:
    if kv_scales is None:
        return None
    if kv_scales.dtype != torch.float32 or not kv_scales.is_contiguous() or kv_scales.numel() != 2:
        raise ValueError("kv_scales must be a contiguous float32 [k_scale, v_scale]")
    return kv_scales.data_ptr()


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Stores token i's `key[i]`/`value[i]` ([num_kv_heads, head_size]) at cache slot `slots[i]`
    (int64, contiguous); an fp8 cache stores them divided by `kv_scales` (as `decode_layer`);
    check `supports` first."""
    _, _, num_kv_heads, block_size, head_size = kv_cache.shape
    status = getattr(kernel(), f"write_kv_{_SUFFIXES[key.dtype]}")(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        slots.data_ptr(),
        slots.shape[0],
        num_kv_heads,
        block_size,
        head_size,
        _CACHE_TYPES[kv_cache.dtype],
        _scales_pointer(kv_scales),
    )
    if status != 0:
        raise RuntimeError(f"native KV write cannot store {key.dtype} rows in a {kv_cache.dtype} cache")
