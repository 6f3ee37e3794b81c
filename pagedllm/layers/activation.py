"""Gated activations (the merged gate/up projection's output of width `2d` -> `d`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """`silu(x[..., :d]) * x[..., d:]` for the merged gate/up projection output of width `2d`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    """`gelu(x[..., :d]) * x[..., d:]`, with the tanh approximation where the model asks for it
    (Gemma's `gelu_pytorch_tanh`)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


def get_act_and_mul(name: str) -> nn.Module:
    """The gated activation for HF's `hidden_act` / `hidden_activation` name."""
    if name == "silu":
        return SiluAndMul()
    if name == "gelu_pytorch_tanh":
        return GeluAndMul("tanh")
    if name == "gelu":
        return GeluAndMul()
    raise ValueError(f"hidden_act={name!r} is not supported (supported: silu, gelu, gelu_pytorch_tanh)")
