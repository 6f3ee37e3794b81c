"""Mixtral: Mistral's attention (optional sliding window) with a sparse feed-forward block in every
layer (`block_sparse_moe` in checkpoints; experts `w1` gate, `w3` up, `w2` down; softmax over the
top-k logits, i.e. top-k weights always renormalized)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from pagedllm.models.llama import MLPFactory
from pagedllm.models.mistral import MistralForCausalLM
from pagedllm.models.moe_block import MoEModelMixin, SparseMoeBlock

if TYPE_CHECKING:
    from pagedllm.quant_interface import QuantizationConfig


class MixtralForCausalLM(MoEModelMixin, MistralForCausalLM):
    expert_projection_names = ("w1", "w2", "w3")
    # The checkpoint's `block_sparse_moe` is the decoder layer's `mlp` here.
    hf_name_substitutions: ClassVar[dict[str, str]] = {".block_sparse_moe.": ".mlp."}

    @classmethod
    def num_experts(cls, config: Any) -> int:
        return int(config.num_local_experts)

    @classmethod
    def mlp_factory(cls, config: Any, quant_config: QuantizationConfig | None) -> MLPFactory | None:
        def build(layer_idx: int, prefix: str) -> nn.Module:
            return SparseMoeBlock(
                config, config.num_local_experts, True, quant_config, prefix, config.intermediate_size
            )

        return build
