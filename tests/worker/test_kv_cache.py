"""The worker's KV cache budget (CPU byte budget; CUDA budget after profiling, with torch.cuda faked)
and cache dtypes."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kv_cache_interface import KVCacheSpec, num_blocks_from_budget
from pagedllm.worker.kv_cache import (
    CPU_DEFAULT_KV_CACHE_CAP_BYTES,
    cpu_kv_cache_budget,
    profile_cuda_kv_cache_budget,
    resolve_cache_dtype,
)


@pytest.mark.parametrize(
    ("cache_dtype", "dtype", "bytes_per_element"),
    [
        ("fp8", torch.float8_e4m3fn, 1),
        ("fp8_e4m3", torch.float8_e4m3fn, 1),
        ("fp8_e5m2", torch.float8_e5m2, 1),
    ],
)
def test_fp8_cache_holds_four_times_the_float32_blocks(
    cache_dtype: str, dtype: torch.dtype, bytes_per_element: int
) -> None:
    assert resolve_cache_dtype(cache_dtype, torch.float32) == dtype
    shape = {"block_size": 16, "num_kv_heads": [3] * 30, "head_size": [64] * 30}
    fp8 = KVCacheSpec(**shape, dtype=dtype)  # type: ignore[arg-type]
    assert fp8.bytes_per_block == 30 * 2 * 16 * 3 * 64 * bytes_per_element
    budget = 64 * 2**20
    for wide, ratio in ((torch.float32, 4), (torch.bfloat16, 2)):
        wide_blocks = num_blocks_from_budget(budget, KVCacheSpec(**shape, dtype=wide).bytes_per_block, None)  # type: ignore[arg-type]
        assert num_blocks_from_budget(budget, fp8.bytes_per_block, None) == ratio * wide_blocks


def test_cpu_budget_caps() -> None:
    assert cpu_kv_cache_budget(0, 12345) == 12345
    assert cpu_kv_cache_budget(0, 2**50) <= CPU_DEFAULT_KV_CACHE_CAP_BYTES


def test_data_parallel_cores_split_the_ram_share(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "default_kv_cache_memory_bytes", lambda weights: 3 * GiB)
    assert cpu_kv_cache_budget(0, 2**50) == 3 * GiB
    assert cpu_kv_cache_budget(0, 2**50, num_engine_cores=2) == 3 * GiB // 2


GiB = 2**30


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, peak: int, total: int, free: int, reserved: int) -> list[str]:
    """Replace the torch.cuda memory queries, so the CUDA budget arithmetic runs on a CPU machine."""
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: events.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    return events


def test_cuda_budget_after_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    # 80 GiB device; torch peaked at 20 GiB during profiling and holds 22 GiB reserved; 2 GiB more are
    # in use outside torch (CUDA context, other processes): 80 - 24 free.
    events = _fake_cuda(monkeypatch, peak=20 * GiB, total=80 * GiB, free=56 * GiB, reserved=22 * GiB)
    budget = profile_cuda_kv_cache_budget(torch.device("cuda:0"), 0.9, lambda: events.append("profile"))
    assert budget == int(0.9 * 80 * GiB) - 20 * GiB - 2 * GiB
    assert events.index("reset") < events.index("profile")


def test_cuda_budget_exhausted_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, peak=70 * GiB, total=80 * GiB, free=8 * GiB, reserved=72 * GiB)
    with pytest.raises(
        RuntimeError, match=r"no GPU memory left for the KV cache.*gpu_memory_utilization=0.5"
    ):
        profile_cuda_kv_cache_budget(torch.device("cuda:0"), 0.5, lambda: None)
