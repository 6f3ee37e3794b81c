"""Mixture-of-experts layers: top-k routing (`router`), the grouped expert product
(`fused_experts`, an opaque op for torch.compile) and the `FusedMoE` layer with its stacked weights."""

from pagedllm.layers.fused_moe.fused_experts import fused_experts
from pagedllm.layers.fused_moe.layer import (
    FusedMoE,
    FusedMoEMethodBase,
    UnquantizedFusedMoEMethod,
    make_expert_params_mapping,
)
from pagedllm.layers.fused_moe.router import select_experts

__all__ = [
    "FusedMoE",
    "FusedMoEMethodBase",
    "UnquantizedFusedMoEMethod",
    "fused_experts",
    "make_expert_params_mapping",
    "select_experts",
]
