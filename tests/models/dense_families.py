"""Tiny random HF models (float32) of the dense families beyond Llama, saved with save_pretrained
beside a tiny tokenizer, each configured so its distinctive paths run: windows of 8 tokens under
40-token prompts, soft caps small enough to bend the scores and logits, LongRoPE past its
pre-training length, non-trivial Granite multipliers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tiny_llm import build_tokenizer
from tiny_models import _COMMON as TINY_SHAPE
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
)

VOCAB = 384  # the tiny tokenizer's size
_COMMON: dict[str, Any] = dict(TINY_SHAPE, vocab_size=VOCAB)
_GEMMA: dict[str, Any] = dict(
    _COMMON,
    num_hidden_layers=3,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=8,
    final_logit_softcapping=3.0,
)


def _families() -> dict[str, tuple[type[PreTrainedModel], Any]]:
    return {
        "gemma2": (
            Gemma2ForCausalLM,
            Gemma2Config(**_GEMMA, attn_logit_softcapping=2.0),
        ),
        "gemma3": (
            Gemma3ForCausalLM,
            Gemma3TextConfig(
                **_GEMMA,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                },
            ),
        ),
        "phi3": (
            Phi3ForCausalLM,
            Phi3Config(
                **_COMMON,
                sliding_window=24,
                original_max_position_embeddings=32,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": [1.0 + 0.1 * i for i in range(8)],
                    "long_factor": [1.0 + 0.7 * i for i in range(8)],
                    "original_max_position_embeddings": 32,
                },
                tie_word_embeddings=False,
            ),
        ),
        "olmo2": (Olmo2ForCausalLM, Olmo2Config(**_COMMON)),
        "granite": (
            GraniteForCausalLM,
            GraniteConfig(
                **_COMMON,
                embedding_multiplier=6.0,
                residual_multiplier=0.3,
                attention_multiplier=0.2,
                logits_scaling=0.5,
            ),
        ),
    }


FAMILIES = sorted(_families())


def make_family_model(
    family: str, path: Path, seed: int = 0, overrides: dict[str, Any] | None = None
) -> PreTrainedModel:
    """Build (its config attributes set from `overrides`), randomize (norm weights around 1, or around
    0 for Gemma's `1 + weight` norms; the rest with std 0.15, so greedy choices are not near-ties) and
    save `family` with a tokenizer to `path`; returns the HF model in eval mode with eager attention."""
    cls, config = _families()[family]
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(path)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return model
