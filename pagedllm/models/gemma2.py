"""Gemma 2 (and, through `Gemma3ForCausalLM`, Gemma 3's text model): the Llama attention and gated MLP
inside "sandwich" norms (each of attention and MLP has a norm before and one after, the latter applied
before the residual add), `(1 + weight)` RMSNorms, a gelu-tanh MLP, embeddings scaled by
sqrt(hidden_size) (rounded to the model dtype, as HF does), scores scaled by
`query_pre_attn_scalar^-0.5` and soft-capped (`attn_logit_softcapping`), sliding-window and global
layers as `layer_types` lists them, and soft-capped logits (`final_logit_softcapping`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.layers.embedding import VocabParallelEmbedding
from pagedllm.layers.norm import GemmaRMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.interfaces import NativeDecoder
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, build_rope

if TYPE_CHECKING:
    from pagedllm.quant_interface import QuantizationConfig

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(config: Any) -> list[str]:
    """Each layer's attention type (Gemma 2 configs without the list alternate, sliding first)."""
    types = getattr(config, "layer_types", None) or [
        SLIDING if i % 2 == 0 else FULL for i in range(config.num_hidden_layers)
    ]
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown or len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types={types} is not supported (one of {SLIDING!r}, {FULL!r} per layer)")
    return list(types)


class GemmaDecoderLayer(LlamaDecoderLayer):
    norm_cls = GemmaRMSNorm

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.pre_feedforward_layernorm = self.make_norm(config)
        self.post_feedforward_layernorm = self.make_norm(config)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(mlp_out, residual)` whose sum is the block's output, as the Llama blocks do."""
        hidden_states, residual = self.input_norm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class GemmaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        prefix: str,
        layer_options: list[dict[str, Any]],
        ropes: dict[str, RotaryEmbedding],
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        """`layer_options[i]` the attention options of layer i, `ropes` the rotary table of each
        layer type (one table per distinct rotation, shared by its layers)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # HF multiplies by sqrt(hidden) as a tensor of the embedding's dtype: the rounded value.
        self.normalizer = float(torch.tensor(config.hidden_size**0.5, dtype=torch.get_default_dtype()))
        types = layer_types(config)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(
                config, f"{prefix}.layers.{i}", ropes[types[i]], quant_config, **layer_options[i]
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) * self.normalizer
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma2ForCausalLM(LlamaForCausalLM):
    # Its body (`GemmaModel`) is not split into pipeline stages.
    supports_pp = False

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, quant_config)
        cap = getattr(config, "final_logit_softcapping", None)
        self.final_logit_softcapping = float(cap) if cap else None

    @classmethod
    def build_model(cls, config: Any, quant_config: QuantizationConfig | None) -> nn.Module:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(f"use_bidirectional_attention=True is not supported for {config.architectures}")
        options = cls.attention_options(config)
        layer_options = [
            dict(options, sliding_window=config.sliding_window if t == SLIDING else None)
            for t in layer_types(config)
        ]
        return GemmaModel(config, "model", layer_options, cls.build_ropes(config), quant_config)

    @classmethod
    def build_ropes(cls, config: Any) -> dict[str, RotaryEmbedding]:
        rope = build_rope(config)
        return {SLIDING: rope, FULL: rope}

    @classmethod
    def attention_options(cls, config: Any) -> dict[str, Any]:
        options = super().attention_options(config)
        cap = getattr(config, "attn_logit_softcapping", None)
        options.update(
            scale=float(config.query_pre_attn_scalar) ** -0.5, logits_soft_cap=float(cap) if cap else None
        )
        return options

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def decoder_layers(self) -> Sequence[nn.Module]:
        # Every layer: the body is one stage (`supports_pp = False`), with no start/end layer to slice.
        return self.model.layers

    def native_decoder(self) -> NativeDecoder | None:
        return None  # the native path has no sandwich norms, soft caps or mixed windows
