"""Qwen3: the Llama architecture with per-head RMSNorm on q and k (before rotary), an explicit
head_dim, and `attention_bias` for all four projections."""

from __future__ import annotations

from typing import Any

from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.qwen2 import reject_sliding_window


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: Any) -> dict[str, Any]:
        reject_sliding_window(config)
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True, "sliding_window": None}
