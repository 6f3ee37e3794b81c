"""RMSNorm with an optional fused residual add (the pre-norm decoder's `x + residual -> norm`), and
the variants other families define: the weight applied before the cast back to the activation dtype
(OLMo 2), and Gemma's `(1 + weight)` scale."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, the statistics computed in float32 as HF does.

    Called with `residual`, it first adds it to `x` (in the activation dtype, as HF's residual
    stream is) and returns `(normed, new_residual)`, so decoder layers carry one residual tensor
    and never materialize the sum twice.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, scale_in_float32: bool = False) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        # OLMo 2 multiplies by the weight before the cast back, Llama after (they differ in bf16).
        self.scale_in_float32 = scale_in_float32
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _normalized(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale_in_float32:
            return (self.weight * self._normalized(x)).to(x.dtype)
        return self.weight * self._normalized(x).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores `weight - 1`, the scale is `1 + weight`, applied in
    float32 before the cast back (as HF's `Gemma2RMSNorm`)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return (self._normalized(x) * (1.0 + self.weight.float())).to(x.dtype)
