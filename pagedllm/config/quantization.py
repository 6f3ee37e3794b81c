"""Quantization in the configuration: the method names and the interface of a resolved method.

pagedllm runs GGUF block quantization (kept packed and computed from the blocks; dequantized at load
only when the loader is asked to, see `pagedllm.models.loader`), 4-bit AWQ / GPTQ checkpoints and fp8
weights (online from an unquantized checkpoint, or an fp8 checkpoint's with their `weight_scale`); every
other method name is rejected by ModelConfig. Each method's `QuantizationConfig` lives beside its linear
method in `pagedllm.layers.quant.<format>`; the loader resolves the configured name to it
(`pagedllm.models.loader.quantization`), so the configuration never imports layers. Construction
checks the checkpoint's parameters early (`pagedllm.formats.quant_params`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn

    from pagedllm.layers.quant.base import QuantizeMethodBase

# A safetensors checkpoint's tensors from their headers: `{name: (file, shape, dtype)}`.
CheckpointTensors = Mapping[str, tuple[Path, list[int], torch.dtype]]


class QuantizationConfig:
    """Base of a resolved quantization method (`EngineConfig.quant_config`, or the loader's)."""

    name: str = ""

    def get_min_capability(self) -> int:
        """Minimum CUDA capability as an int (e.g. 75 for 7.5)."""
        raise NotImplementedError

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        raise NotImplementedError

    def has_blocked_weights(self) -> bool:
        """Whether weights use block-wise FP8 scales (needs the `quant_fp8` custom op)."""
        return False

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method that creates, loads and applies the weights of `layer` (named `prefix` in the
        model, e.g. "model.layers.0.mlp.down_proj"), or None to leave it unquantized."""
        raise NotImplementedError

    def maybe_update_config(self, model: str, hf_config: Any = None, revision: str | None = None) -> None:
        """Let the method adjust itself to the checkpoint; methods without such needs keep the base."""

    def check_checkpoint(self, tensors: CheckpointTensors) -> None:
        """Refuse a checkpoint (`{tensor name: (file, shape, dtype)}`) this method cannot read, naming
        the file and the tensor; methods whose layers check their own tensors keep the base."""

    def compute_hash(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# The methods pagedllm runs, each a `QuantizationConfig` in `pagedllm.layers.quant.<format>` that the loader
# (`pagedllm.models.loader.quantization`) resolves by this name.
QUANTIZATION_METHODS = ("gguf", "awq", "gptq", "fp8")
# The methods a checkpoint's config.json names in `quantization_config.quant_method`.
CHECKPOINT_METHODS = ("awq", "gptq", "fp8")
# Those of them that can also quantize an unquantized checkpoint at load.
ONLINE_METHODS = ("fp8",)
