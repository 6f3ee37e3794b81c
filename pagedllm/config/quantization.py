"""Quantization methods known to the config: the resolved method object lives in
`EngineConfig.quant_config`. pagedllm implements GGUF block quantization (kept packed and computed
from the blocks; dequantized at load only when the loader is asked to, see `pagedllm.models.loader`);
every other method name is rejected by ModelConfig."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn

    from pagedllm.layers.quant.base import QuantizeMethodBase


class QuantizationConfig:
    """Base of a resolved quantization method."""

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

    def compute_hash(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class GGUFQuantizationConfig(QuantizationConfig):
    """llama.cpp block quantization (Q4_0, Q4_1, Q8_0, K-quants...) read from a .gguf file."""

    name = "gguf"

    def get_min_capability(self) -> int:
        return 60

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        # Linear layers and the token embedding (with a tied or own LM head) keep the file's blocks;
        # other layers (norms, mixture-of-experts weights) get dequantized tensors from the loader.
        from pagedllm.layers.embedding import VocabParallelEmbedding
        from pagedllm.layers.linear import LinearBase
        from pagedllm.layers.quant.gguf import GGUFLinearMethod, embedding_method

        if isinstance(layer, LinearBase):
            return GGUFLinearMethod()
        if isinstance(layer, VocabParallelEmbedding):
            return embedding_method(layer)
        return None


QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {"gguf": GGUFQuantizationConfig}


def get_quantization_method(name: str) -> QuantizationConfig:
    if name not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization={name!r} is not supported; supported: {', '.join(sorted(QUANTIZATION_METHODS))}"
        )
    return QUANTIZATION_METHODS[name]()
