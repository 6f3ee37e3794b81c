"""AttentionConfig: attention backend selection."""

from __future__ import annotations

from typing import Any, Literal

from pagedllm.config.utils import config, hash_fields


@config
class AttentionConfig:
    """Configuration of attention."""

    backend: Literal["torch_paged", "triton_paged"] | None = None
    """Attention backend; unset picks the platform's best (torch_paged on CPU, triton_paged on CUDA)."""
    hisparse_config: dict[str, Any] | None = None
    """Hierarchical sparse attention settings (HiSparse); unset disables it."""

    def compute_hash(self) -> str:
        return hash_fields(self, ("backend", "hisparse_config"))
