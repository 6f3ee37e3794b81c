"""The attention backend interface: one metadata object for a flattened mixed batch.

The batch is the concatenation of every scheduled request's new tokens (no padding). Request ``i`` owns
query rows ``query_start_loc[i]:query_start_loc[i+1]``; its keys are the ``seq_lens[i]`` tokens
``0..seq_lens[i]-1`` of its sequence, of which the first ``num_computed_tokens[i]`` are already in the KV
cache (a cached prefix or earlier chunks) and the rest are this step's tokens, written to the cache at
``slot_mapping`` before attention. Causal masking is per request: query token ``j`` (absolute position
``num_computed_tokens[i] + j``) sees keys ``0..num_computed_tokens[i] + j`` (the last
``sliding_window`` of them, for a layer with a window). A decode, a request verifying draft tokens
and a prompt chunk are all the same case.

The runner fills a `CommonAttentionMetadata` once per step and hands it to the backend's
`AttentionMetadataBuilder`, which returns the backend's own `AttentionMetadata` with every per-step
precomputation done (index tensors, kernel argument structures); the forward context carries it to
every layer, which only reads it.

KV cache layout per layer: ``[2, num_blocks, num_kv_heads, block_size, head_dim]`` (key, value;
head-major inside a block, so a gathered block is ready for batched GEMMs per head without a layout
copy). Allocate it with ``backend.get_kv_cache_shape(...)``, zero-filled. Slot ``s`` is block
``s // block_size``, offset ``s % block_size``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch


@dataclass
class CommonAttentionMetadata:
    """A step's inputs to attention, the same for every backend (built by the runner)."""

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
    # Python copies of the small per-request vectors, for builders that plan on the host.
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # Set on the first prompt step when `calculate_kv_scales` is on: each layer sets its fp8 cache's
    # key and value scales from this step's keys and values before storing them.
    calculate_kv_scales: bool = False


@dataclass
class AttentionMetadata(CommonAttentionMetadata):
    """A backend's metadata for one step: the common inputs plus what its builder precomputed
    (backends subclass it). Built once per step, read by every layer, never written by them."""


class AttentionParams(NamedTuple):
    """What distinguishes one layer's attention computation from another's: the op resolves the
    impl by it (see `pagedllm.attention.layer`). No window is 0, no soft cap 0.0."""

    num_heads: int
    head_size: int
    scale: float
    num_kv_heads: int
    sliding_window: int
    logits_soft_cap: float


class AttentionImpl(ABC):
    """One layer's attention computation for a flattened mixed batch: its head layout, its sliding
    window (keys older than `sliding_window` positions are not attended) and its logits soft cap
    (Gemma-2: scores become `cap * tanh(score / cap)` before the softmax)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, not {sliding_window}")
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be positive or None, not {logits_soft_cap}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.params = AttentionParams(
            num_heads, head_size, scale, num_kv_heads, sliding_window or 0, logits_soft_cap or 0.0
        )

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`query` [T, num_heads, head_size], `key`/`value` [T, num_kv_heads, head_size] (heads
        contiguous within each row) -> [T, num_heads, head_size]. Writes this step's keys/values into
        `kv_cache` at `attn_metadata.slot_mapping` first; with `attn_metadata=None` (profiling) the T
        tokens are attended as one causal sequence and the cache is not touched. `attn_metadata` must
        come from this backend's builder over a set of layers that included this one. `kv_scales`:
        the layer's float32 `[k_scale, v_scale]` of an fp8 cache (`pagedllm.attention.fp8_kv`; None
        reads as 1.0), set from this step's keys and values when `attn_metadata.calculate_kv_scales`."""


class AttentionLayer(Protocol):
    """What a builder reads of a layer: its impl and its bound cache."""

    impl: AttentionImpl
    kv_cache: torch.Tensor


class AttentionMetadataBuilder(ABC):
    """Turns a step's common inputs into the backend's metadata for the given layers (their impls
    and bound caches, fixed for the builder's life: build a new builder when caches are bound anew).
    `dtype` is the layers' activation dtype; `compiled_decode` says the forward is compiled (O1+),
    so the backend may use compiled kernels too."""

    def __init__(
        self,
        layers: Iterable[AttentionLayer],
        dtype: torch.dtype,
        device: torch.device,
        compiled_decode: bool = False,
    ) -> None:
        self.dtype = dtype
        self.device = device
        self.compiled_decode = compiled_decode

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """The step's metadata, with every per-step precomputation the layers need done here."""

    def backend_names(self) -> dict[str, list[str]]:
        """The kernel backends each step class runs on across the layers, by the class's name (none
        named by default)."""
        return {}


class AttentionBackend(ABC):
    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]: ...

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
