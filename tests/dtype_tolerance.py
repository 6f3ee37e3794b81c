"""Tolerances for results computed in the machine's default dtype (`dtype="auto"`: bfloat16 on CPUs with
native bf16 dot products, float32 elsewhere) against a float32 reference.

The bound is measured, not guessed: transformers runs the same model in the same dtype, and our result
may be off the float32 reference by at most twice what that dtype's rounding moves transformers' result
(two implementations round at different places; measured on the tiny models here, our error is 0.9-1.2x
transformers'), plus the float32 tolerance. In float32 the second term is zero and the check is the
float32 one; in bfloat16 it is a few bf16 ulps of the values compared. A wrong result (wrong pooling, a
layer skipped, a stage's hidden state lost) is off by far more than either."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TypeVar

import torch

M = TypeVar("M", bound=torch.nn.Module)

# How many times transformers' own rounding error in the dtype our result may make.
ROUNDING_FACTOR = 2.0


def in_dtype(model: M, dtype: torch.dtype) -> M:
    """A copy of `model` with its parameters in `dtype` (the float32 original is kept)."""
    return copy.deepcopy(model).to(dtype)


def dtype_atol(reference: torch.Tensor, reference_in_dtype: torch.Tensor, atol: float) -> float:
    """The absolute tolerance for a result computed in the dtype `reference_in_dtype` was computed in
    (by transformers, on the same inputs as the float32 `reference`)."""
    rounding = (reference_in_dtype.float() - reference.float()).abs().max().item()
    return atol + ROUNDING_FACTOR * rounding


def assert_close_in_dtype(
    got: torch.Tensor,
    reference: Callable[[torch.dtype], torch.Tensor],
    dtype: torch.dtype,
    atol: float = 1e-4,
    rtol: float = 1e-4,
) -> float:
    """`got`, computed in `dtype`, against `reference(torch.float32)` within `dtype_atol` of
    `reference(dtype)`; returns the tolerance used."""
    exact = reference(torch.float32).float()
    tolerance = atol if dtype == torch.float32 else dtype_atol(exact, reference(dtype), atol)
    torch.testing.assert_close(got.float(), exact, atol=tolerance, rtol=rtol)
    return tolerance
