"""The interface between the configuration, the loader and the layers for quantization: a resolved
method (`QuantizationConfig`: `EngineConfig.quant_config`, or the one the loader resolves from
`model_config.quantization`) and what it gives each layer (`QuantizeMethodBase`). Each format implements
both in `pagedllm.layers.quant.<format>`; the method names live in `pagedllm.config.quantization`. Here,
below config and layers, so that neither imports the other for them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

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


class QuantizeMethodBase(ABC):
    """Creates, loads and applies the weights of one layer."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for input `x`."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once every checkpoint tensor is in place (repacking, scales); nothing by default."""
        return None

    def constants(self, layer: nn.Module) -> tuple[object, ...]:
        """What a graph traced through `apply` bakes in of this layer besides its tensors (block
        types of a GGUF layer): one traced decoder block serves only layers with equal constants."""
        return ()
