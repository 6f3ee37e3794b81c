"""The EAGLE-1 draft head of a Llama-family target (Li et al. 2024), in the layout the published
checkpoints use (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B; config.json is a LlamaConfig with the head's
depth, usually one layer):

    fc.weight [H, 2H] (fc.bias where the checkpoint has one)
    layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.mlp.{gate,up,down}_proj.weight,
    layers.{i}.post_attention_layernorm.weight, layers.{i>0}.input_layernorm.weight
    embed_tokens.weight (optional: without it the head shares the target's embedding)

At position i the head reads the embedding of token i + 1 and the target's final hidden state at i,
fuses them (`fc` of their concatenation), runs its decoder layers (the first one without an input
norm: its input is not a residual stream) and returns a feature standing for the target's hidden
state at i + 1; the TARGET's LM head turns it into the next draft's logits, and the feature is the
next position's hidden-state input when drafting goes on.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.layers.embedding import VocabParallelEmbedding
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, build_rope


class EagleHead(nn.Module):
    """What EAGLE heads share: an optional embedding of their own (else the target's), the `fc` that
    fuses the target's hidden state(s), the Llama checkpoint names."""

    stacked_params_mapping: ClassVar[list[tuple[str, str, str | int]]] = LlamaForCausalLM.stacked_params_mapping
    skip_weight_substrs: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    def __init__(self, config: Any, own_embedding: bool, fc_inputs: int, fc_bias: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, hidden, None, "embed_tokens") if own_embedding else None
        )
        self.fc = nn.Linear(fc_inputs * hidden, hidden, bias=fc_bias)

    def share_embedding(self, embedding: nn.Module) -> None:
        """Use the target's embedding (a checkpoint without its own)."""
        if self.embed_tokens is None:
            self.embed_tokens = embedding

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None, "share_embedding() first"
        return self.embed_tokens(input_ids)


class EagleLlamaDraft(EagleHead):
    def __init__(self, config: Any, fc_bias: bool, own_embedding: bool) -> None:
        super().__init__(config, own_embedding, 2, fc_bias)
        rotary = build_rope(config)
        options = LlamaForCausalLM.attention_options(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, f"layers.{i}", rotary, None, None, **options)
            for i in range(config.num_hidden_layers)
        )
        self.layers[0].input_layernorm = nn.Identity()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([self.embed(input_ids), hidden_states.to(self.fc.weight.dtype)], dim=-1))
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        assert residual is not None
        return x + residual
