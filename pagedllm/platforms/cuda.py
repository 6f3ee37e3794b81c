"""The CUDA platform. The capability can be given explicitly so CUDA rules run on a CPU machine."""

from __future__ import annotations

import torch

from pagedllm.platforms.base import DeviceCapability, Platform, PlatformEnum


class CudaPlatform(Platform):
    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"

    def __init__(self, capability: tuple[int, int] | None = None) -> None:
        # A given capability means "behave as that GPU" without asking the driver (tests, planning).
        self._capability = DeviceCapability(*capability) if capability is not None else None

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        if self._capability is not None:
            return self._capability
        major, minor = torch.cuda.get_device_capability(device_id)
        return DeviceCapability(major, minor)

    def get_device_name(self, device_id: int = 0) -> str:
        if self._capability is not None:
            return f"cuda (capability {self._capability.as_version_str()})"
        return torch.cuda.get_device_name(device_id)

    def support_static_graph_mode(self) -> bool:
        return True

    def support_hybrid_kv_cache(self) -> bool:
        return True

    def supports_async_scheduling(self) -> bool:
        return True

    def supports_background_kv_copies(self) -> bool:
        # Host <-> device copies run on the copy engine; the thread only queues and waits for them.
        return True

    def default_max_num_batched_tokens(self) -> int:
        return 8192

    def default_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        # Keep a half-precision checkpoint's dtype; fp32 checkpoints run in bf16 (tensor cores).
        # bf16 needs Ampere (8.0); older GPUs get fp16.
        if checkpoint_dtype in (torch.bfloat16, torch.float16):
            wanted = checkpoint_dtype
        else:
            wanted = torch.bfloat16
        if wanted == torch.bfloat16 and not self.has_device_capability((8, 0)):
            return torch.float16
        return wanted

    def is_pin_memory_available(self) -> bool:
        return True

    def release_freed_memory(self) -> None:
        # Freed blocks stay in torch's caching allocator until emptied.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
