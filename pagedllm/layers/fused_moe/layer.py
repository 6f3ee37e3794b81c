"""`FusedMoE`: a mixture-of-experts layer whose experts' weights are stacked, `w13_weight`
[E, 2I, H] (each expert's gate rows, then its up rows) and `w2_weight` [E, H, I].

Like a linear layer, it delegates creating its weights and computing its product to a method chosen
by the `QuantizationConfig` (`FusedMoEMethodBase`, unquantized by default). Checkpoints store each
expert's projections separately (HF `experts.{e}.gate_proj/up_proj/down_proj`, Mixtral's
`experts.{e}.w1/w3/w2`); `make_expert_params_mapping` tells the generic loader which stacked
parameter, expert and shard ("w1" gate, "w3" up, "w2" down) each of them fills, and the
parameters' `weight_loader(param, loaded_weight, shard_id, expert_id)` copies it into place.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.distributed import parallel_state
from pagedllm.layers.fused_moe.router import select_experts
from pagedllm.layers.linear import default_weight_loader
from pagedllm.layers.quant.base import set_weight_loader
from pagedllm.quant_interface import QuantizeMethodBase

if TYPE_CHECKING:
    from pagedllm.quant_interface import QuantizationConfig

# (stacked parameter name prefix, checkpoint name part, expert id, shard id), as vLLM's mapping.
ExpertParamsMapping = list[tuple[str, str, int, str]]
_SHARDS = ("w1", "w2", "w3")


def make_expert_params_mapping(
    gate_name: str, down_name: str, up_name: str, num_experts: int
) -> ExpertParamsMapping:
    """Where each expert's checkpoint projections go: `experts.{e}.{gate_name}.` fills shard "w1" of
    `experts.w13_weight`, `{up_name}` shard "w3", `{down_name}` shard "w2" of `experts.w2_weight`."""
    return [
        ("experts.w2_" if shard == "w2" else "experts.w13_", f"experts.{expert}.{name}.", expert, shard)
        for expert in range(num_experts)
        for shard, name in (("w1", gate_name), ("w2", down_name), ("w3", up_name))
    ]


class FusedMoEMethodBase(QuantizeMethodBase):
    """Creates, loads and applies the stacked expert weights of a `FusedMoE` layer."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        """Register `w13_weight` and `w2_weight` (each with the layer's `weight_loader`) on `layer`."""

    # As vLLM's FusedMoEMethodBase: the product takes the routing where a linear method takes a bias.
    @abstractmethod
    def apply(  # type: ignore[override]
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The experts' weighted outputs summed per token."""


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Dense expert weights in the activation dtype, applied by `pagedllm::fused_experts`."""

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        shapes = {
            "w13_weight": (num_experts, 2 * intermediate_size, hidden_size),
            "w2_weight": (num_experts, hidden_size, intermediate_size),
        }
        for name, shape in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=params_dtype), requires_grad=False)
            layer.register_parameter(name, set_weight_loader(param, layer.weight_loader))

    def apply(  # type: ignore[override]
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        # The op is registered by the package's `fused_experts` module, imported before this one.
        return torch.ops.pagedllm.fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)


class FusedMoE(nn.Module):
    """`forward(hidden_states [T, H], router_logits [T, E]) -> [T, H]`: each token through its
    `top_k` experts (SiLU-gated MLPs of width `intermediate_size`), weighted by the router."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if parallel_state.get_tensor_model_parallel_world_size() != 1:
            raise ValueError("mixture-of-experts layers are not sharded across tensor-parallel ranks yet")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.prefix = prefix
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        if method is not None and not isinstance(method, FusedMoEMethodBase):
            raise ValueError(
                f"quantization {quant_config} has no method for mixture-of-experts layers ({prefix})"
            )
        self.quant_method: FusedMoEMethodBase = method or UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(
            self, num_experts, hidden_size, intermediate_size, torch.get_default_dtype()
        )

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str | int | None, expert_id: int
    ) -> None:
        """Copy one expert's gate ("w1"), up ("w3") or down ("w2") projection into its slice."""
        if shard_id not in _SHARDS:
            raise ValueError(f"unknown expert shard id {shard_id!r} (expected one of {', '.join(_SHARDS)})")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} out of range (the layer has {self.num_experts} experts)")
        target = param.data[expert_id]
        if shard_id != "w2":
            size = self.intermediate_size
            target = target.narrow(0, 0 if shard_id == "w1" else size, size)
        default_weight_loader(target, loaded_weight)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.quant_method.apply(self, hidden_states, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, renormalize={self.renormalize}"
        )
