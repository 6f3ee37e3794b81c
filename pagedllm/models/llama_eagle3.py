"""The EAGLE-3 draft head of a Llama-family target (Li et al. 2025), in the layout the published
checkpoints use (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B; config.json is a one-layer LlamaConfig
with `draft_vocab_size`):

    fc.weight [H, 3H]                       the target's three auxiliary hidden states, fused
    midlayer.input_layernorm.weight         on the token embedding
    midlayer.hidden_norm.weight             on the fused hidden state
    midlayer.self_attn.{q,k,v}_proj.weight  [.., 2H]: they read [embedding, hidden] side by side
    midlayer.self_attn.o_proj.weight, midlayer.post_attention_layernorm.weight, midlayer.mlp.*
    norm.weight, lm_head.weight [draft_vocab, H]
    d2t [draft_vocab]                       target id = draft id + d2t[draft id]
    t2d [vocab]                             (not needed to draft)
    embed_tokens.weight                     (optional: without it the head shares the target's)

At position i the head reads the embedding of token i + 1 and, in the catch-up over the target's
tokens, `fc` of the target's residual streams entering three of its layers at i (`aux_layer_ids`);
when drafting further, its own previous output instead. Its output (before the final norm) is that
next input; `compute_logits` maps the small vocabulary's logits into the target's.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.layers.embedding import LogitsProcessor, ParallelLMHead
from pagedllm.layers.linear import RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, build_rope, head_dim
from pagedllm.models.llama_eagle import EagleHead


def aux_layer_ids(head_config: Any, num_target_layers: int) -> list[int]:
    """The target layers whose input streams the head reads (vLLM's default: 2, N/2, N-3)."""
    ids = getattr(head_config, "eagle_aux_hidden_state_layer_ids", None)
    return list(ids) if ids else [2, num_target_layers // 2, num_target_layers - 3]


class Eagle3LlamaDraft(EagleHead):
    skip_weight_substrs: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq", "t2d")
    hf_name_substitutions: ClassVar[dict[str, str]] = {"midlayer.": "layers.0."}

    def __init__(self, config: Any, own_embedding: bool) -> None:
        super().__init__(config, own_embedding, 3, False)
        hidden = config.hidden_size
        rotary = build_rope(config)
        options = LlamaForCausalLM.attention_options(config)
        layer = LlamaDecoderLayer(config, "layers.0", rotary, None, None, **options)
        # The attention reads [embedding, hidden] (2H wide) and writes H.
        wide = copy.copy(config)
        wide.hidden_size, wide.head_dim = 2 * hidden, head_dim(config)
        attn = LlamaAttention(wide, "layers.0.self_attn", rotary, **options)
        attn.o_proj = RowParallelLinear(
            config.num_attention_heads * wide.head_dim, hidden, options["o_bias"], None, "layers.0.self_attn.o_proj"
        )
        layer.self_attn = attn
        layer.hidden_norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.target_vocab_size = int(config.vocab_size)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden, prefix="lm_head")
        self.logits_processor = LogitsProcessor()
        self.d2t = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.int64), requires_grad=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states.to(self.fc.weight.dtype)
        if hidden_states.shape[-1] != self.fc.out_features:
            hidden_states = self.fc(hidden_states)
        layer = self.layers[0]
        residual = hidden_states
        x = torch.cat([layer.input_layernorm(self.embed(input_ids)), layer.hidden_norm(hidden_states)], dim=-1)
        x = layer.self_attn(positions, x)
        x, residual = layer.post_attention_layernorm(x, residual)
        return layer.mlp(x) + residual

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[tokens, target vocab] logits: the draft vocabulary's at their target ids, -inf elsewhere."""
        draft = self.logits_processor(self.lm_head, self.norm(hidden_states))[:, : self.draft_vocab_size]
        logits = draft.new_full((draft.shape[0], self.target_vocab_size), float("-inf"))
        logits[:, torch.arange(self.draft_vocab_size, device=draft.device) + self.d2t] = draft
        return logits
