"""The worker's side of the KV cache: the byte budget the platform allows, and the cache tensors.

The engine core turns the budget into a block count (`pagedllm.kv_cache_interface`); the runner then
allocates that many blocks per layer (`kv_cache_interface.allocate_zeroed`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pagedllm.attention.fp8_kv import FP8_CACHE_DTYPES
from pagedllm.platforms import current_platform

logger = logging.getLogger("pagedllm.worker")

# Upper bound of the default CPU KV budget. The cache is zero-filled at start-up (every page is
# touched), and on a host shared with the API server, the tokenizer and other engines a larger default
# would claim RAM most workloads never use; set `kv_cache_memory_bytes` to go beyond it.
CPU_DEFAULT_KV_CACHE_CAP_BYTES = 4 * 2**30


def cpu_kv_cache_budget(weights_bytes: int, max_useful_bytes: int, num_engine_cores: int = 1) -> int:
    """The default CPU budget: the platform's share of available RAM (it leaves room for the
    weights), capped at `CPU_DEFAULT_KV_CACHE_CAP_BYTES` and at `max_useful_bytes` (every sequence the
    scheduler may run at full length; more blocks would only ever serve the prefix cache).
    ``num_engine_cores``: the data parallel cores of one server, which start together, each seeing the
    same free RAM: they split the share."""
    share = current_platform.default_kv_cache_memory_bytes(weights_bytes) // num_engine_cores
    budget = min(share, CPU_DEFAULT_KV_CACHE_CAP_BYTES, max_useful_bytes)
    logger.info(
        "CPU KV cache budget %.1f MiB (RAM share %.1f MiB, cap %.1f MiB, full occupancy %.1f MiB)",
        budget / 2**20,
        share / 2**20,
        CPU_DEFAULT_KV_CACHE_CAP_BYTES / 2**20,
        max_useful_bytes / 2**20,
    )
    return budget


def profile_cuda_kv_cache_budget(
    device: torch.device, gpu_memory_utilization: float, profile: Callable[[], None]
) -> int:
    """`gpu_memory_utilization * total` minus the peak memory of `profile()` (weights + activations
    as torch allocated them) and the memory torch does not own (CUDA context, other processes)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    peak_torch = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = total - free - torch.cuda.memory_reserved(device)
    budget = int(gpu_memory_utilization * total) - peak_torch - max(non_torch, 0)
    torch.cuda.empty_cache()
    logger.info(
        "CUDA KV cache budget %.2f GiB (%.0f%% of %.2f GiB, torch peak %.2f GiB, non-torch %.2f GiB)",
        budget / 2**30,
        gpu_memory_utilization * 100,
        total / 2**30,
        peak_torch / 2**30,
        non_torch / 2**30,
    )
    if budget <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization={gpu_memory_utilization} allows "
            f"{gpu_memory_utilization * total / 2**30:.2f} GiB, but the weights and a profiling forward used "
            f"{(peak_torch + non_torch) / 2**30:.2f} GiB; raise gpu_memory_utilization or lower "
            "max_num_batched_tokens / max_model_len"
        )
    return budget


def resolve_cache_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for `cache_config.cache_dtype` (an fp8 one holds 1-byte elements, so
    the same budget holds more blocks: `KVCacheSpec.bytes_per_block`)."""
    if cache_dtype == "auto":
        return model_dtype
    dtypes = {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        **FP8_CACHE_DTYPES,
    }
    if cache_dtype not in dtypes:
        raise ValueError(
            f"cache_dtype={cache_dtype!r} is not supported by the model runner yet "
            f"(supported: auto, {', '.join(dtypes)})"
        )
    return dtypes[cache_dtype]
