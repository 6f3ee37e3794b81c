"""LoRAConfig: LoRA adapters served beside the base model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from pagedllm.config.utils import config, hash_fields

if TYPE_CHECKING:
    from pagedllm.config.model import ModelConfig


@config
class LoRAConfig:
    """Configuration of LoRA adapters."""

    max_lora_rank: Annotated[int, Field(ge=1)] = 16
    """Largest LoRA rank served."""
    max_loras: Annotated[int, Field(ge=1)] = 1
    """LoRA adapters in one batch."""
    max_cpu_loras: Annotated[int, Field(ge=1)] | None = None
    """LoRA adapters kept in CPU memory; unset: max_loras."""
    fully_sharded_loras: bool = False
    """Shard LoRA weights fully across tensor parallel ranks."""
    lora_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Data type of LoRA weights; "auto" uses the model dtype."""
    lora_allowed_roots: list[str] | None = None
    """Directories adapters may be read from (static and runtime-loaded, offline LoRARequest paths):
    a path outside them, by '..' or a link, is refused. Unset: any path the server can read."""

    def __post_init__(self) -> None:
        for root in self.lora_allowed_roots or ():
            if not Path(root).expanduser().is_dir():
                raise ValueError(f"lora_allowed_roots: {root!r} is not a directory")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    def verify_with_model_config(self, model_config: ModelConfig | None) -> None:
        if model_config is not None and model_config.quantization not in (None, "gguf"):
            raise ValueError(f"LoRA is not supported with quantization={model_config.quantization!r}")

    def compute_hash(self) -> str:
        return hash_fields(self, ("max_lora_rank", "max_loras", "fully_sharded_loras", "lora_dtype"))
