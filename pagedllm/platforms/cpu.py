"""The CPU platform: no CUDA graphs, bf16 where the CPU has native bf16 dot products (else float32),
thread count and KV budget from the host."""

from __future__ import annotations

import ctypes
import functools
import os
from typing import TYPE_CHECKING

import psutil
import torch

from pagedllm.platforms.base import Platform, PlatformEnum

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig

# Entries each of torch's oneDNN kernel caches keeps (ideep's LRU_CACHE_CAPACITY and oneDNN's
# ONEDNN_PRIMITIVE_CACHE_CAPACITY default to 1024): `CpuPlatform.bound_kernel_caches`.
KERNEL_CACHE_CAPACITY = 64

# Share of the memory still available after the weights are loaded that the KV cache may take by
# default: the rest stays for activations, the tokenizer, the API server and the OS page cache.
DEFAULT_KV_CACHE_SHARE = 0.4


class CpuPlatform(Platform):
    _enum = PlatformEnum.CPU
    device_name = "cpu"
    device_type = "cpu"

    def default_max_num_batched_tokens(self) -> int:
        # Large enough to prefill a typical prompt in one step, small enough that one step's
        # activations stay in cache-friendly sizes on a few cores.
        return 4096

    def default_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        # With native bf16 dot products (AVX512-BF16 or AMX-BF16) bf16 halves the bytes every decode
        # step reads and about doubles the GEMM rate (figures: benchmarks/RESULTS.md, "Figures behind
        # code choices"). Without them bf16 is emulated and slower than fp32, which is exact anyway.
        return torch.bfloat16 if self.has_native_bf16() else torch.float32

    @staticmethod
    @functools.cache
    def cpu_flags() -> tuple[str, ...]:
        """The CPU's feature flags from /proc/cpuinfo (`flags` on x86, `Features` on Arm); empty
        where there is no such file."""
        try:
            with open("/proc/cpuinfo") as f:
                line = next((line for line in f if line.startswith(("flags", "Features"))), "")
        except OSError:
            return ()
        return tuple(line.partition(":")[2].split())

    @classmethod
    def has_native_bf16(cls) -> bool:
        """Whether the CPU executes bf16 dot products natively (Linux: the cpuinfo flags)."""
        flags = cls.cpu_flags()
        return "avx512_bf16" in flags or "amx_bf16" in flags

    @classmethod
    def has_amx_bf16(cls) -> bool:
        """Whether the CPU has AMX bf16 tiles (torch's bf16 GEMM, oneDNN, runs on them)."""
        return "amx_bf16" in cls.cpu_flags()

    @staticmethod
    def tune_allocator() -> bool:
        """Keep freed memory in glibc's heap instead of returning it to the OS.

        By default glibc serves every allocation above 128 KiB-32 MiB with a fresh `mmap` and unmaps
        it on free, so each step's activation and gather buffers are page-faulted (and zeroed by the
        kernel) again, which made a large `index_select` several times slower than from a reused heap
        (figures: benchmarks/RESULTS.md, "Figures behind code choices").
        Returns whether the settings took (False off glibc)."""
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:
            return False
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        return all(
            libc.mallopt(option, value) == 1
            for option, value in (
                (m_mmap_threshold, 1 << 30),
                (m_trim_threshold, (1 << 31) - 1),
                (m_top_pad, 1 << 28),
            )
        )

    @staticmethod
    def bound_kernel_caches() -> None:
        """Bound the caches of compiled oneDNN kernels that torch's bf16 GEMMs fill, one entry per
        shape: ideep's (`LRU_CACHE_CAPACITY`) and oneDNN's primitive cache
        (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`), 1024 entries each by default. A serving step's row count
        changes with every batch, so both kept growing for as long as new counts appeared: the engine
        core's memory grew by hundreds of MiB over rounds of the same load. Both libraries read the
        variable when the cache is first used, so this runs before the worker's first GEMM; an
        operator's own setting wins."""
        for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
            os.environ.setdefault(name, str(KERNEL_CACHE_CAPACITY))

    def release_freed_memory(self) -> None:
        """`malloc_trim(0)`: `tune_allocator` keeps freed memory in glibc's heap, so dropped weights
        would stay resident; trimming returns every free page (mmap'd blocks, the KV cache, are
        returned when their tensor is freed)."""
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: nothing to trim
            pass

    def get_cpu_count(self) -> int:
        affinity = getattr(os, "sched_getaffinity", None)
        return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)

    def get_available_memory_bytes(self) -> int:
        return int(psutil.virtual_memory().available)

    def default_kv_cache_memory_bytes(self, weights_bytes: int) -> int:
        """KV budget when `CacheConfig.kv_cache_memory_bytes` is unset, after weights are loaded."""
        free = max(self.get_available_memory_bytes() - weights_bytes, 0)
        return int(free * DEFAULT_KV_CACHE_SHARE)

    def check_and_update_config(self, cfg: EngineConfig) -> None:
        # No CUDA graphs exist on CPU whatever the optimization level asked for.
        from pagedllm.config.compilation import CUDAGraphMode

        cfg.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
