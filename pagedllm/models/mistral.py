"""Mistral: the Llama architecture plus an optional sliding attention window."""

from __future__ import annotations

from typing import Any

from pagedllm.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: Any) -> dict[str, Any]:
        options = super().attention_options(config)
        options["sliding_window"] = getattr(config, "sliding_window", None)
        return options
