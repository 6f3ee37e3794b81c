"""IBM Granite (3.x dense): the Llama architecture with four scalars from the config: embeddings
times `embedding_multiplier`, attention scores scaled by `attention_multiplier` (not head_dim^-0.5),
each block's attention and MLP outputs times `residual_multiplier` before the residual add, and the
logits divided by `logits_scaling`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagedllm.models.interfaces import NativeDecoder
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM

if TYPE_CHECKING:
    from pagedllm.quant_interface import QuantizationConfig


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.input_norm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states) * self.residual_multiplier
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, quant_config)
        self.logits_scaling = float(config.logits_scaling)

    layer_cls = GraniteDecoderLayer

    @classmethod
    def embed_scale(cls, config: Any) -> float | None:
        return float(config.embedding_multiplier)

    @classmethod
    def attention_options(cls, config: Any) -> dict[str, Any]:
        options = super().attention_options(config)
        options["scale"] = float(config.attention_multiplier)
        return options

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) / self.logits_scaling

    def native_decoder(self) -> NativeDecoder | None:
        return None  # the native path has no multipliers
