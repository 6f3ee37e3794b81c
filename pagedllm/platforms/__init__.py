"""`current_platform`: the one object in pagedllm that answers "which device are we on?".

`current_platform` is a proxy, so modules that imported it see `override_platform(...)` take effect:
```
with override_platform("cuda", capability=(9, 0)):
    cfg = EngineConfig(...)   # construction runs the CUDA rules, no device is touched
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch

from pagedllm.platforms.base import DeviceCapability, Platform, PlatformEnum
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.cuda import CudaPlatform

__all__ = [
    "CpuPlatform",
    "CudaPlatform",
    "DeviceCapability",
    "Platform",
    "PlatformEnum",
    "current_platform",
    "detect_platform",
    "override_platform",
]


def detect_platform() -> Platform:
    """CUDA when a CUDA device is usable, else CPU."""
    if torch.cuda.is_available():
        return CudaPlatform()
    return CpuPlatform()


class _PlatformProxy:
    """Forwards every attribute to the active platform (detected lazily, once)."""

    def __init__(self) -> None:
        self._stack: list[Platform] = []
        self._detected: Platform | None = None

    def _active(self) -> Platform:
        if self._stack:
            return self._stack[-1]
        if self._detected is None:
            self._detected = detect_platform()
        return self._detected

    def __getattr__(self, name: str) -> Any:
        return getattr(self._active(), name)

    def __repr__(self) -> str:
        return f"current_platform -> {self._active()!r}"


current_platform: Any = _PlatformProxy()


@contextlib.contextmanager
def override_platform(
    kind: Literal["cpu", "cuda"], capability: tuple[int, int] | None = None
) -> Iterator[Platform]:
    """Make `current_platform` answer as `kind` (with `capability` for CUDA) inside the block."""
    if kind == "cpu":
        if capability is not None:
            raise ValueError("override_platform: capability is only meaningful for 'cuda'")
        platform: Platform = CpuPlatform()
    elif kind == "cuda":
        platform = CudaPlatform(capability=capability if capability is not None else (9, 0))
    else:
        raise ValueError(f"override_platform: unknown platform {kind!r}; expected 'cpu' or 'cuda'")
    proxy: _PlatformProxy = current_platform
    proxy._stack.append(platform)
    try:
        yield platform
    finally:
        proxy._stack.pop()
