"""Phi-3 / Phi-3.5: the Llama architecture with q/k/v and gate/up stored fused in the checkpoint
(`qkv_proj`, `gate_up_proj`, already our layers' layout), LongRoPE ("su") scaling, and an optional
sliding window over every layer."""

from __future__ import annotations

from typing import Any, ClassVar

from pagedllm.models.interfaces import NativeDecoder
from pagedllm.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # The checkpoint's tensors are the fused ones: nothing to fold at load time.
    stacked_params_mapping: ClassVar[list[tuple[str, str, str | int]]] = []
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["qkv_proj"],
        "gate_up_proj": ["gate_up_proj"],
    }

    @classmethod
    def attention_options(cls, config: Any) -> dict[str, Any]:
        options = super().attention_options(config)
        options["sliding_window"] = getattr(config, "sliding_window", None)
        return options

    def native_decoder(self) -> NativeDecoder | None:
        return None  # the native path is written for (and tested on) Llama checkpoints only
