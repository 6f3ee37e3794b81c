"""Which attention backend a model uses."""

from __future__ import annotations

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.backends.torch_paged import TorchPagedAttentionBackend


def get_attn_backend() -> type[AttentionBackend]:
    """The portable PyTorch backend, on every platform for now: it is what the CPU runs, and the
    correct fallback on CUDA until a fused GPU kernel backend is added here."""
    return TorchPagedAttentionBackend
