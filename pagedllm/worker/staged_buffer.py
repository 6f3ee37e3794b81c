"""Persistent step-input buffers: written on the host with numpy, visible to the device without a
per-step allocation."""

from __future__ import annotations

import torch


class StagedBuffer:
    """A persistent host buffer (numpy view for vectorized writes) mirrored on the device.

    On CPU the device tensor *is* the host tensor: inputs are built in place with no copy. On CUDA the
    host side is pinned and copied asynchronously into a persistent device tensor, so no device memory
    is allocated per step (and the addresses stay fixed for graph capture later)."""

    def __init__(
        self, size: int | tuple[int, ...], dtype: torch.dtype, device: torch.device, pin: bool
    ) -> None:
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.device = self.cpu if device.type == "cpu" else torch.zeros(size, dtype=dtype, device=device)

    def to_device(self, n: int) -> torch.Tensor:
        if self.device is self.cpu:
            return self.cpu[:n]
        self.device[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.device[:n]
