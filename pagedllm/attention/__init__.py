"""Attention: the backend interface, the paged PyTorch backend and the layer models use."""

from pagedllm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionParams,
    CommonAttentionMetadata,
)
from pagedllm.attention.layer import Attention, AttentionGraphKey, attention_layers, bind_kv_cache
from pagedllm.attention.selector import get_attn_backend

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionGraphKey",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionParams",
    "CommonAttentionMetadata",
    "attention_layers",
    "bind_kv_cache",
    "get_attn_backend",
]
