"""Qwen2-MoE: Qwen2's attention (`qkv_bias`) with sparse feed-forward blocks that add a shared expert
gated by `sigmoid(shared_expert_gate(x))`; top-k weights renormalized only when `norm_topk_prob`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.models.llama import MLPFactory
from pagedllm.models.moe_block import MoEModelMixin, qwen_moe_mlp_factory
from pagedllm.models.qwen2 import Qwen2ForCausalLM, reject_sliding_window

if TYPE_CHECKING:
    from pagedllm.quant_interface import QuantizationConfig


class Qwen2MoeForCausalLM(MoEModelMixin, Qwen2ForCausalLM):
    @classmethod
    def attention_options(cls, config: Any) -> dict[str, Any]:
        reject_sliding_window(config)
        return {
            "qkv_bias": bool(getattr(config, "qkv_bias", True)),
            "o_bias": False,
            "qk_norm": False,
            "sliding_window": None,
        }

    @classmethod
    def mlp_factory(cls, config: Any, quant_config: QuantizationConfig | None) -> MLPFactory | None:
        return qwen_moe_mlp_factory(config, quant_config)
