"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with sparse feed-forward blocks (softmax
routing, top-k weights renormalized when `norm_topk_prob`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.models.llama import MLPFactory
from pagedllm.models.moe_block import MoEModelMixin, qwen_moe_mlp_factory
from pagedllm.models.qwen3 import Qwen3ForCausalLM

if TYPE_CHECKING:
    from pagedllm.quant_interface import QuantizationConfig


class Qwen3MoeForCausalLM(MoEModelMixin, Qwen3ForCausalLM):
    @classmethod
    def mlp_factory(cls, config: Any, quant_config: QuantizationConfig | None) -> MLPFactory | None:
        return qwen_moe_mlp_factory(config, quant_config)
