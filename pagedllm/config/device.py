"""DeviceConfig: the device the model runs on."""

from __future__ import annotations

from typing import Literal

import torch

from pagedllm.config.utils import config, hash_fields


@config
class DeviceConfig:
    """Configuration of the target device."""

    device: Literal["auto", "cpu", "cuda"] | torch.device = "auto"
    """Device to run on; "auto" asks the platform (CUDA when a GPU is usable, else CPU)."""

    def __post_init__(self) -> None:
        from pagedllm.platforms import current_platform

        if isinstance(self.device, torch.device):
            kind = self.device.type
        elif self.device == "auto":
            kind = current_platform.device_type
        else:
            kind = self.device
        if kind != current_platform.device_type:
            raise ValueError(
                f"device={kind!r} but the current platform is {current_platform.device_type!r}; "
                f"pagedllm runs on the detected platform only"
            )
        self.device_type: str = kind
        self.device = self.device if isinstance(self.device, torch.device) else torch.device(kind)

    def compute_hash(self) -> str:
        return hash_fields(self, ("device_type",))
