"""Tiny random HF causal LMs (float32) saved with save_pretrained, one per supported variant."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
VARIANTS: dict[str, tuple[type[PreTrainedModel], Any]] = {
    "llama-llama3rope": (
        LlamaForCausalLM,
        LlamaConfig(**_COMMON, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE),
    ),
    "llama-tied-linearrope": (
        LlamaForCausalLM,
        LlamaConfig(**_COMMON, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    "mistral-window20": (MistralForCausalLM, MistralConfig(**_COMMON, sliding_window=20)),
    "qwen2-bias": (Qwen2ForCausalLM, Qwen2Config(**_COMMON, tie_word_embeddings=False)),
    "qwen3-qknorm": (Qwen3ForCausalLM, Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True)),
    # Mixture of experts: 8 experts, 2 to 4 per token; the first Qwen3-MoE layer dense (mlp_only_layers).
    "qwen3moe-top4-norm": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(
            **_COMMON | {"num_hidden_layers": 3},
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=4,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),
    "qwen2moe-top2-shared": (
        Qwen2MoeForCausalLM,
        Qwen2MoeConfig(
            **_COMMON,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
        ),
    ),
    "mixtral-top3": (
        MixtralForCausalLM,
        MixtralConfig(**_COMMON, num_local_experts=8, num_experts_per_tok=3, sliding_window=None),
    ),
}


def make_tiny_model(variant: str, path: Path, seed: int = 0, **config_overrides: Any) -> PreTrainedModel:
    """Build, randomize (biases and norm weights included, so nothing is trivially zero or one) and
    save the variant (its config attributes `config_overrides` changed) to `path`; returns the HF model
    in eval mode with eager attention."""
    cls, config = VARIANTS[variant]
    if config_overrides:
        config = copy.deepcopy(config)
        for name, value in config_overrides.items():
            setattr(config, name, value)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model
