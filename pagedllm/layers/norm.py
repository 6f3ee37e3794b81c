"""RMSNorm with an optional fused residual add (the pre-norm decoder's `x + residual -> norm`)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, the statistics computed in float32 as HF does.

    Called with `residual`, it first adds it to `x` (in the activation dtype, as HF's residual
    stream is) and returns `(normed, new_residual)`, so decoder layers carry one residual tensor
    and never materialize the sum twice.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        orig_dtype = x.dtype
        xf = x.to(torch.float32)
        variance = xf.pow(2).mean(dim=-1, keepdim=True)
        xf = xf * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * xf.to(orig_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
