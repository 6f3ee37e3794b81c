"""The native CPU paged decode-attention kernel (cpu_decode.c): build once, load, call.

Decode attention in tensor ops must first gather every request's key and value blocks into a batch
(a bandwidth-bound copy of everything attended to, then read again by small batched GEMMs); this
kernel reads the blocks where they lie, once, with the query heads of a group sharing each read. The
shared object is compiled with the system C compiler (the one torch.compile needs on CPU anyway) into
the pagedllm cache directory, keyed by the source, the flags, the compiler and the CPU, so it is
built once per machine. Without a working compiler `kernel()` is None and the backend keeps its tensor-op paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pagedllm.config.utils import cache_root
from pagedllm.platforms.cpu import CpuPlatform

logger = logging.getLogger("pagedllm.attention")

_SOURCE = Path(__file__).with_name("cpu_decode.c")
# Tried in order: the best code for this CPU first, then plainer builds (a compiler without OpenMP
# still gives a correct single-threaded kernel). Reassociation lets the compiler sum a dot product's
# vector lanes as a tree instead of a chain of scalar adds (3x on this kernel); unlike -ffast-math it
# changes no process-wide floating-point state.
_MATH = ["-O3", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
_FLAG_SETS = (
    [*_MATH, "-march=native", "-fopenmp"],
    [*_MATH, "-fopenmp"],
    _MATH,
)
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_DECODE_ARGTYPES = [
    ctypes.c_void_p,  # q
    ctypes.c_int64,  # q row stride
    ctypes.c_void_p,  # k cache
    ctypes.c_void_p,  # v cache
    ctypes.c_void_p,  # block tables
    ctypes.c_int64,  # block table row stride
    ctypes.c_void_p,  # query row of each decode request
    ctypes.c_void_p,  # block-table row of each decode request
    ctypes.c_void_p,  # seq lens
    ctypes.c_int64,  # decode requests
    ctypes.c_int64,  # heads
    ctypes.c_int64,  # kv heads
    ctypes.c_int64,  # head size
    ctypes.c_int64,  # block size
    ctypes.c_float,  # scale
    ctypes.c_int64,  # sliding window (0: none)
    ctypes.c_void_p,  # out
    ctypes.c_int64,  # out row stride
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
]
# The C kernel's fixed per-thread buffers (MAX_GROUP, MAX_HEAD, MAX_BLOCK) and vector width (LANES).
MAX_GROUP, MAX_HEAD, MAX_BLOCK, LANES = 16, 256, 256, 16


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    """What `-march=native` compiles for: a cache directory shared by machines with different CPUs
    (a network home) must not hand one of them another's instructions."""
    return " ".join([platform.machine(), platform.processor(), *CpuPlatform.cpu_flags()])


def _build(compiler: str) -> Path | None:
    source = _SOURCE.read_bytes()
    for flags in _FLAG_SETS:
        recipe = " ".join([compiler, *flags, _cpu_signature()])
        key = hashlib.sha256(source + recipe.encode()).hexdigest()[:16]
        target = cache_root() / "native" / f"cpu_decode-{key}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent processes never load a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [compiler, *flags, "-shared", "-fPIC", "-o", tmp, str(_SOURCE)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode == 0:
            os.replace(tmp, target)
            return target
        os.unlink(tmp)
        logger.debug("native decode kernel: %s failed: %s", " ".join(cmd), result.stderr.strip())
    return None


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it cannot be built (logged once)."""
    compiler = _compiler()
    try:
        path = _build(compiler) if compiler else None
    except OSError as e:  # e.g. a read-only cache directory (set PAGEDLLM_CACHE_ROOT)
        logger.warning("cannot build the CPU decode-attention kernel: %s", e)
        path = None
    if path is None:
        logger.warning(
            "no C compiler could build the CPU decode-attention kernel (set CC); decode attention "
            "uses tensor ops, which are slower"
        )
        return None
    lib = ctypes.CDLL(str(path))
    for suffix in _SUFFIXES.values():
        getattr(lib, f"paged_decode_{suffix}").argtypes = _DECODE_ARGTYPES
        getattr(lib, f"paged_decode_{suffix}").restype = ctypes.c_int
        getattr(lib, f"write_kv_{suffix}").argtypes = _WRITE_ARGTYPES
        getattr(lib, f"write_kv_{suffix}").restype = None
    return lib


def supports(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> bool:
    """Whether `write_kv` and `paged_decode` can serve this layer: CPU tensors of one supported
    dtype, heads contiguous within each token row."""
    _, _, _, block_size, head_size = kv_cache.shape
    return (
        query.device.type == "cpu"
        and query.dtype == key.dtype == value.dtype == kv_cache.dtype
        and query.dtype in _SUFFIXES
        and kv_cache.is_contiguous()
        and all(t.stride(2) == 1 and t.stride(1) == head_size for t in (query, key, value))
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_size <= MAX_HEAD
        and head_size % LANES == 0
        and block_size <= MAX_BLOCK
        and kernel() is not None
    )


def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_rows: torch.Tensor,
    table_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
    out: torch.Tensor,
) -> None:
    """Writes `out[q_rows[i]]`, the attention of `query[q_rows[i]]` [heads, head_size] over the first
    `seq_lens[i]` keys (the last `window`, if > 0) of the request in `block_tables[table_rows[i]]`.
    Index tensors are int64, the tables int32; check `supports` first."""
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be int32 with contiguous rows")
    _, _, num_kv_heads, block_size, head_size = kv_cache.shape
    fn = getattr(kernel(), f"paged_decode_{_SUFFIXES[query.dtype]}")
    status = fn(
        query.data_ptr(),
        query.stride(0),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        q_rows.data_ptr(),
        table_rows.data_ptr(),
        seq_lens.data_ptr(),
        q_rows.shape[0],
        query.shape[1],
        num_kv_heads,
        head_size,
        block_size,
        scale,
        window,
        out.data_ptr(),
        out.stride(0),
    )
    if status != 0:
        raise RuntimeError("native decode kernel rejected its shapes (check supports() first)")


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Stores token i's `key[i]`/`value[i]` ([num_kv_heads, head_size]) at cache slot `slots[i]`
    (int64, contiguous); check `supports` first."""
    _, _, num_kv_heads, block_size, head_size = kv_cache.shape
    getattr(kernel(), f"write_kv_{_SUFFIXES[key.dtype]}")(
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
    )
