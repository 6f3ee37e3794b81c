"""The platform abstraction: the only place in pagedllm that knows which device it runs on.

Config construction asks the platform questions (does it support static CUDA graphs, which dtype is
fast and exact, what is its device capability) and lets it have the last word on a few settings
(`apply_config_platform_defaults` early, `check_and_update_config` late). Keeping every
hardware-specific answer behind this interface is what lets the CUDA rules be exercised on a CPU
machine through `pagedllm.platforms.override_platform`.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig


class PlatformEnum(enum.Enum):
    CPU = enum.auto()
    CUDA = enum.auto()


class DeviceCapability(NamedTuple):
    """A GPU compute capability such as (9, 0); tuple-comparable, e.g. `cap >= (8, 0)`."""

    major: int
    minor: int

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"

    def to_int(self) -> int:
        """(9, 0) -> 90, the form quantization methods state their minimum capability in."""
        return self.major * 10 + self.minor


class Platform:
    """Base class; subclasses answer for one device kind."""

    _enum: PlatformEnum
    device_name: str
    device_type: str
    # torch.distributed backend of collectives between processes on this device (weight transfer).
    dist_backend: str = "gloo"

    def is_cpu(self) -> bool:
        return self._enum == PlatformEnum.CPU

    def is_cuda(self) -> bool:
        return self._enum == PlatformEnum.CUDA

    def is_rocm(self) -> bool:
        # ROCm is not a supported platform of pagedllm; the question exists because config rules ask it.
        return False

    def is_tpu(self) -> bool:
        return False

    def is_out_of_tree(self) -> bool:
        return False

    def is_cuda_alike(self) -> bool:
        return self.is_cuda() or self.is_rocm()

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        """None on devices without a compute capability (CPU)."""
        return None

    def has_device_capability(self, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        current = self.get_device_capability(device_id)
        if current is None:
            return False
        if isinstance(capability, tuple):
            return current >= capability
        return current.to_int() >= capability

    def is_device_capability(self, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        current = self.get_device_capability(device_id)
        if current is None:
            return False
        if isinstance(capability, tuple):
            return current == capability
        return current.to_int() == capability

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        """Same major version: family 100 covers 10.0 and 10.3 (data-center Blackwell)."""
        current = self.get_device_capability(device_id)
        if current is None:
            return False
        return current.to_int() // 10 == capability // 10

    def get_device_name(self, device_id: int = 0) -> str:
        return self.device_name

    def support_static_graph_mode(self) -> bool:
        """Whether whole-forward graphs can be captured and replayed (CUDA graphs)."""
        return False

    def support_hybrid_kv_cache(self) -> bool:
        """Whether the hybrid KV cache manager (several KV cache groups) is supported."""
        return False

    def supports_async_scheduling(self) -> bool:
        """Whether the engine can overlap scheduling of step N+1 with execution of step N here."""
        return False

    def supports_background_kv_copies(self) -> bool:
        """Whether a KV connector's copies should run on a thread beside the forward. Not where the KV
        cache is host memory: the copies would take the forward's own cores, and the copy thread's
        OpenMP team spins after each copy, slowing every decode step (figures: benchmarks/RESULTS.md,
        "Figures behind code choices")."""
        return False

    def default_compile_backend(self) -> str:
        return "inductor"

    def default_max_num_batched_tokens(self) -> int:
        raise NotImplementedError

    def default_max_num_seqs(self) -> int:
        return 256

    def default_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """The dtype `dtype="auto"` resolves to for a checkpoint stored in `checkpoint_dtype`."""
        raise NotImplementedError

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def is_pin_memory_available(self) -> bool:
        return False

    def release_freed_memory(self) -> None:
        """Hand memory freed by dropped tensors back to the OS / the device (sleep mode)."""

    def default_breakable_cudagraph_architectures(self) -> frozenset[str]:
        """Architectures whose graphs are captured breakable by default (none in pagedllm)."""
        return frozenset()

    def apply_config_platform_defaults(self, cfg: EngineConfig) -> None:
        """Early hook (step P32): fill platform defaults before the level table is applied."""
        compilation = cfg.compilation_config
        if compilation.backend == "":
            compilation.backend = self.default_compile_backend()

    def check_and_update_config(self, cfg: EngineConfig) -> None:
        """Late hook (step P48): the platform's final say on the combined configuration."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device_type={self.device_type!r})"
