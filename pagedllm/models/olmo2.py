"""OLMo 2: no pre-norms; each block's attention and MLP outputs are normalized before the residual add
(`post_attention_layernorm`, `post_feedforward_layernorm`), q and k are RMS-normalized over the whole
projection (all heads at once) before rotary, and every norm applies its weight in float32."""

from __future__ import annotations

import functools
from typing import Any

import torch

from pagedllm.layers.norm import RMSNorm
from pagedllm.models.interfaces import NativeDecoder
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM

Olmo2RMSNorm = functools.partial(RMSNorm, scale_in_float32=True)


class Olmo2DecoderLayer(LlamaDecoderLayer):
    norm_cls = Olmo2RMSNorm

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        del self.input_layernorm  # no pre-norms
        self.post_feedforward_layernorm = self.make_norm(config)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(mlp_out, residual)` whose sum is the block's output (the next block, or the final
        norm, adds them), as the Llama blocks do."""
        if residual is not None:
            hidden_states = hidden_states + residual
        residual = hidden_states + self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


class Olmo2ForCausalLM(LlamaForCausalLM):
    layer_cls = Olmo2DecoderLayer

    @classmethod
    def attention_options(cls, config: Any) -> dict[str, Any]:
        options = super().attention_options(config)
        options.update(qk_norm=True, qk_norm_whole=True, norm_cls=Olmo2RMSNorm)
        return options

    def native_decoder(self) -> NativeDecoder | None:
        return None  # the native path has pre-norm blocks only
