"""Carries per-step attention metadata to the attention layers, so model code stays
``forward(input_ids, positions)`` (nano-vllm's context object)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.attention.backend import AttentionMetadata


@dataclass
class ForwardContext:
    # The step's metadata from the backend's builder; None in profiling and warm-up runs.
    attn_metadata: AttentionMetadata | None


_forward_context: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None) -> Iterator[None]:
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata)
    try:
        yield
    finally:
        _forward_context = prev


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, "attention ran outside set_forward_context()"
    return _forward_context
