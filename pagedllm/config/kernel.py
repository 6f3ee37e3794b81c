"""KernelConfig: kernel selection, IR op provider priorities, JIT warm-up."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from pagedllm.config.utils import config, hash_fields

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig


@config
class IrOpPriorityConfig:
    """Ordered kernel providers per IR op; element 0 is preferred. Empty: the platform default."""

    rms_norm: list[str] = Field(default_factory=list)
    """Providers of RMSNorm."""
    fused_add_rms_norm: list[str] = Field(default_factory=list)
    """Providers of residual-add + RMSNorm."""

    def compute_hash(self) -> str:
        return hash_fields(self, ("rms_norm", "fused_add_rms_norm"))


@config
class KernelConfig:
    """Configuration of kernel selection."""

    enable_jit_warmup: bool = True
    """Run JIT-compiled kernels once at start-up so the first request does not pay for compilation."""
    enable_flashinfer_autotune: bool | None = None
    """Autotune FlashInfer kernels at start-up; unset: from the optimization level."""
    ir_op_priority: IrOpPriorityConfig = Field(default_factory=IrOpPriorityConfig)
    """Kernel provider priorities per IR op."""

    def set_platform_defaults(self, cfg: EngineConfig) -> None:
        """Fill empty provider lists: pagedllm's own ("native") kernels on every platform."""
        priority = self.ir_op_priority
        if not priority.rms_norm:
            priority.rms_norm = ["native"]
        if not priority.fused_add_rms_norm:
            priority.fused_add_rms_norm = ["native"]

    def compute_hash(self) -> str:
        return hash_fields(self, ("ir_op_priority",))
