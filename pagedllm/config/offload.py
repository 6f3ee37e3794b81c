"""OffloadConfig: model weight offloading to CPU memory."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pagedllm.config.utils import config, hash_fields


@config
class OffloadConfig:
    """Configuration of model weight offloading (GPU only)."""

    cpu_offload_gb: Annotated[float, Field(ge=0)] = 0.0
    """GiB of weights kept in CPU memory and streamed to the GPU each forward; 0 disables it."""

    def compute_hash(self) -> str:
        return hash_fields(self, ("cpu_offload_gb",))
