"""current_platform detection, capability questions and override_platform."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.platforms import (
    CpuPlatform,
    CudaPlatform,
    DeviceCapability,
    current_platform,
    override_platform,
)
from pagedllm.platforms.cpu import KERNEL_CACHE_CAPACITY


def test_detected_platform_matches_torch() -> None:
    assert current_platform.is_cuda() == torch.cuda.is_available()
    assert current_platform.device_type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_override_nests_and_restores() -> None:
    before = current_platform.device_type
    with override_platform("cuda", capability=(10, 0)) as outer:
        assert isinstance(outer, CudaPlatform) and current_platform.is_cuda()
        assert current_platform.get_device_capability() == DeviceCapability(10, 0)
        assert current_platform.is_device_capability_family(
            100
        ) and not current_platform.is_device_capability(90)
        with override_platform("cpu"):
            assert current_platform.is_cpu() and current_platform.get_device_capability() is None
        assert current_platform.is_cuda()
    assert current_platform.device_type == before


def test_capability_helpers() -> None:
    cap = DeviceCapability(9, 0)
    assert cap.to_int() == 90 and cap >= (8, 0) and cap.as_version_str() == "9.0"
    with override_platform("cuda", capability=(9, 0)):
        assert current_platform.is_device_capability(90) and current_platform.is_device_capability((9, 0))
        assert current_platform.has_device_capability((8, 0)) and not current_platform.has_device_capability(
            100
        )
        assert current_platform.support_static_graph_mode() and current_platform.support_hybrid_kv_cache()


def test_dtype_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = CpuPlatform()
    monkeypatch.setattr(CpuPlatform, "has_native_bf16", staticmethod(lambda: False))
    assert cpu.default_dtype(torch.bfloat16) == torch.float32
    monkeypatch.setattr(CpuPlatform, "has_native_bf16", staticmethod(lambda: True))
    assert cpu.default_dtype(torch.float32) == torch.bfloat16 and cpu.default_dtype(None) == torch.bfloat16
    hopper, turing = CudaPlatform((9, 0)), CudaPlatform((7, 5))
    assert hopper.default_dtype(torch.float16) == torch.float16
    assert (
        hopper.default_dtype(torch.float32) == torch.bfloat16 and hopper.default_dtype(None) == torch.bfloat16
    )
    assert turing.default_dtype(torch.bfloat16) == torch.float16


@pytest.mark.parametrize(
    ("flags", "native", "amx"),
    [(("avx2",), False, False), (("avx512_bf16",), True, False), (("avx512_bf16", "amx_bf16"), True, True)],
)
def test_bf16_capabilities_come_from_the_cpu_flags(
    monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...], native: bool, amx: bool
) -> None:
    monkeypatch.setattr(CpuPlatform, "cpu_flags", staticmethod(lambda: flags))
    assert CpuPlatform.has_native_bf16() == native and CpuPlatform.has_amx_bf16() == amx


def test_cpu_budgets() -> None:
    cpu = CpuPlatform()
    assert cpu.get_cpu_count() >= 1
    assert 0 < cpu.default_kv_cache_memory_bytes(0) < cpu.get_available_memory_bytes()
    assert cpu.default_kv_cache_memory_bytes(10**18) == 0
    assert not cpu.support_static_graph_mode() and cpu.default_max_num_batched_tokens() == 4096


def test_kernel_caches_are_bounded_unless_the_operator_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    CpuPlatform.bound_kernel_caches()
    assert os.environ.get("LRU_CACHE_CAPACITY") == str(KERNEL_CACHE_CAPACITY)
    assert os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") == "7"


def test_bad_override() -> None:
    with pytest.raises(ValueError, match="unknown platform"):
        with override_platform("tpu"):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match="capability"):
        with override_platform("cpu", capability=(9, 0)):
            pass
