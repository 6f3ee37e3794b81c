"""`load_format="dummy"`: random weights, no files read (for benchmarks and profiling)."""

from __future__ import annotations

import torch
from torch import nn


def initialize_dummy_weights(
    model: nn.Module, seed: int | None = 0, low: float = -1e-3, high: float = 1e-3
) -> None:
    """Uniform values in [low, high] for every parameter: small enough that activations stay finite
    through any depth, reproducible for a given seed."""
    generator = torch.Generator(device="cpu").manual_seed(0 if seed is None else seed)
    for param in model.parameters():
        if param.device.type == "cpu":
            param.data.uniform_(low, high, generator=generator)
        else:
            values = torch.empty(param.shape, dtype=param.dtype).uniform_(low, high, generator=generator)
            param.data.copy_(values)
