"""The attention backend interface: one metadata object for a flattened mixed batch.

The batch is the concatenation of every scheduled request's new tokens (no padding). Request ``i`` owns
query rows ``query_start_loc[i]:query_start_loc[i+1]``; its keys are the ``seq_lens[i]`` tokens
``0..seq_lens[i]-1`` of its sequence, of which the first ``num_computed_tokens[i]`` are already in the KV
cache (a cached prefix or earlier chunks) and the rest are this step's tokens, written to the cache at
``slot_mapping`` before attention. Causal masking is per request: query token ``j`` (absolute position
``num_computed_tokens[i] + j``) sees keys ``0..num_computed_tokens[i] + j``.

KV cache layout per layer: ``[2, num_blocks, num_kv_heads, block_size, head_dim]`` (key, value;
head-major inside a block, so a gathered block is ready for batched GEMMs per head without a layout
copy). Allocate it with ``backend.get_kv_cache_shape(...)``, zero-filled. Slot ``s`` is block
``s // block_size``, offset ``s % block_size``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    num_actual_tokens: int
    num_reqs: int
    # int32 [num_reqs + 1], on the model's device.
    query_start_loc: torch.Tensor
    # int32 [num_reqs]: total tokens per request after this step.
    seq_lens: torch.Tensor
    # int32 [num_reqs]: tokens already in the cache before this step.
    num_computed_tokens: torch.Tensor
    # int32 [num_reqs, max_blocks_per_req]; unused entries are 0.
    block_tables: torch.Tensor
    # int64 [num_actual_tokens]: cache slot of each new token.
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Python copies of the small per-request vectors, for backends that loop or bucket on the host.
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # Whether the step runs a compiled forward (O1+): backends may then use compiled kernels too.
    compiled_decode: bool = False
    # Backend-private per-step precomputation (index tensors shared by every layer), filled by the
    # backend on the first layer of the step. Build a fresh metadata object for each step.
    backend_cache: dict[Any, Any] = field(default_factory=dict, repr=False)


class AttentionImpl(ABC):
    """One layer's attention computation for a flattened mixed batch."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
    ) -> None:
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        """`query` [T, num_heads, head_size], `key`/`value` [T, num_kv_heads, head_size] ->
        [T, num_heads, head_size]. Writes this step's keys/values into `kv_cache` at
        `attn_metadata.slot_mapping` first; with `attn_metadata=None` (profiling) the T tokens are
        attended as one causal sequence and the cache is not touched."""


class AttentionBackend(ABC):
    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's cache tensor (the layout in this module's docstring)."""
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    @staticmethod
    def warm_up(device: torch.device) -> None:
        """Build or load whatever the backend compiles on first use, at engine start-up (nothing, by
        default)."""
        return None
