"""The sparse feed-forward block of mixture-of-experts decoders (Qwen2-MoE, Qwen3-MoE, Mixtral) and
what such a model declares beyond its dense base: which layers are sparse, where each expert's
checkpoint tensors go, and that it has no native decode path.

The block: router logits from a replicated `gate` ([E, H], never quantized: top-k selection is
sensitive to it), the routed experts (`FusedMoE`), and optionally (Qwen2-MoE) a shared expert, a
dense MLP every token goes through, scaled by `sigmoid(shared_expert_gate(x))`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.layers.fused_moe import FusedMoE, make_expert_params_mapping
from pagedllm.models.llama import LlamaMLP, MLPFactory

if TYPE_CHECKING:
    from pagedllm.models.interfaces import NativeDecoder
    from pagedllm.quant_interface import QuantizationConfig

logger = logging.getLogger(__name__)


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        config: Any,
        num_experts: int,
        renormalize: bool,
        quant_config: QuantizationConfig | None,
        prefix: str,
        intermediate_size: int,
        shared_expert_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported for experts (only 'silu')")
        hidden = config.hidden_size
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = FusedMoE(
            num_experts,
            config.num_experts_per_tok,
            hidden,
            intermediate_size,
            renormalize,
            quant_config,
            f"{prefix}.experts",
        )
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(
                hidden,
                shared_expert_intermediate_size,
                config.hidden_act,
                quant_config=quant_config,
                prefix=f"{prefix}.shared_expert",
            )
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(hidden_states)
            out = out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        return out


def qwen_moe_mlp_factory(config: Any, quant_config: QuantizationConfig | None) -> MLPFactory:
    """Qwen2-MoE / Qwen3-MoE layers: sparse unless listed in `mlp_only_layers` or off the
    `decoder_sparse_step` stride (then a dense MLP of `intermediate_size`)."""
    dense_layers = set(getattr(config, "mlp_only_layers", None) or [])
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)

    def build(layer_idx: int, prefix: str) -> nn.Module:
        if layer_idx in dense_layers or (layer_idx + 1) % step != 0:
            return LlamaMLP(
                config.hidden_size, config.intermediate_size, config.hidden_act, False, quant_config, prefix
            )
        return SparseMoeBlock(
            config,
            config.num_experts,
            bool(getattr(config, "norm_topk_prob", False)),
            quant_config,
            prefix,
            config.moe_intermediate_size,
            int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
        )

    return build


class MoEModelMixin:
    """Mixed into a `LlamaForCausalLM` subclass: the experts' checkpoint mapping and no native path."""

    # Each expert's checkpoint projection names: (gate, down, up).
    expert_projection_names: tuple[str, str, str] = ("gate_proj", "down_proj", "up_proj")
    config: Any

    @classmethod
    def num_experts(cls, config: Any) -> int:
        return int(config.num_experts)

    @property
    def expert_params_mapping(self) -> list[tuple[str, str, int, str]]:
        gate, down, up = self.expert_projection_names
        return make_expert_params_mapping(gate, down, up, self.num_experts(self.config))

    def native_decoder(self) -> NativeDecoder | None:
        logger.info("single-sequence decode steps run the compiled graphs: the native path has no experts")
        return None
