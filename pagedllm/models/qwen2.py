"""Qwen2: the Llama architecture with biases on the q/k/v projections (not on o_proj)."""

from __future__ import annotations

from typing import Any

from pagedllm.models.llama import LlamaForCausalLM


def reject_sliding_window(config: Any) -> None:
    if getattr(config, "use_sliding_window", False):
        raise ValueError(f"use_sliding_window=True is not supported for {config.architectures}")


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: Any) -> dict[str, Any]:
        reject_sliding_window(config)
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False, "sliding_window": None}
