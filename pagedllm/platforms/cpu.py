"""The CPU platform: no CUDA graphs, float32 by default, thread count and KV budget from the host."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import psutil
import torch

from pagedllm.platforms.base import Platform, PlatformEnum

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig

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
        # float32 is exact, and bf16 matrix-vector products (decode) run at half the fp32 rate on
        # x86 CPUs without a bf16 GEMV path, so float32 wins for the latency-bound case.
        return torch.float32

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
