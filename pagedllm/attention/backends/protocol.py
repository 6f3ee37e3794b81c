"""What a CPU attention kernel backend declares and takes.

A step's rows fall into classes (`StepClass`): decode rows (a request with at most
`MAX_DECODE_QUERY_LEN` new tokens: a decode or draft verification, one row per token) in steps of few
or of many such rows, and prompt segments (a whole prompt or a chunk over a cached prefix). A mixed
step has both classes; each is run by the backend the composite (`hybrid`) chose for it. A backend
says which classes of a layer it serves (`unsupported` gives the reason it does not), so the
composite never asks what a backend is, only what it can do.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from pagedllm.attention import fp8_kv
from pagedllm.attention.backend import AttentionImpl, CommonAttentionMetadata

# Requests with at most this many new tokens run as decode rows (each token attends to its own
# prefix, read from the cache where this step's keys were stored first): single-token decodes and
# the 1 + k tokens of a request verifying k drafts. Longer ones are prompt segments, whose kernels
# read each key once for a tile of query rows instead of once per row.
MAX_DECODE_QUERY_LEN = 8

# A decode step of at most this many rows is of class FEW_DECODES: the compiled dense kernel serves
# it (no per-block bookkeeping ops, which dominate when there are few rows: figures in
# benchmarks/RESULTS.md, "Figures behind code choices"); with more rows its padding to the longest
# block table costs more than it saves.
DENSE_DECODE_MAX_REQS = 8


class StepClass(enum.Enum):
    FEW_DECODES = f"decode steps of 1..{DENSE_DECODE_MAX_REQS} rows"
    DECODES = f"decode steps of more than {DENSE_DECODE_MAX_REQS} rows"
    PROMPTS = "prompt segments"


class UnsupportedAttention(ValueError):
    """No backend serves a layer's step class: a clear error rather than a silently wrong output."""


@dataclass(frozen=True)
class AttentionFeatures:
    """What the backends condition on: a layer's head layout, window and soft cap (0 for none), its
    activations' dtype, its cache (dtype, device, layout), and whether the forward is compiled."""

    dtype: torch.dtype
    cache_dtype: torch.dtype
    device_type: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    sliding_window: int
    logits_soft_cap: float
    compiled: bool
    # The bound cache itself, for the native kernels' own check of it.
    kv_cache: torch.Tensor = field(compare=False, repr=False)

    @classmethod
    def of_layer(
        cls, impl: AttentionImpl, kv_cache: torch.Tensor, dtype: torch.dtype, compiled: bool
    ) -> AttentionFeatures:
        return cls(
            dtype,
            kv_cache.dtype,
            kv_cache.device.type,
            impl.num_heads,
            impl.num_kv_heads,
            kv_cache.shape[4],
            kv_cache.shape[3],
            impl.params.sliding_window,
            impl.params.logits_soft_cap,
            compiled,
            kv_cache,
        )

    @property
    def fp8(self) -> bool:
        return fp8_kv.is_fp8(self.cache_dtype)


@dataclass
class DecodeRows:
    """The step's decode rows: per row its query row, its request (block-table row) and its number
    of keys (position + 1), int64 on the host."""

    q_rows: np.ndarray
    reqs: np.ndarray
    seq_lens: np.ndarray


@dataclass
class PrefillSegment:
    req: int
    start: int
    end: int
    num_computed: int
    seq_len: int


@dataclass(slots=True)
class LayerCall:
    """One layer's call in a step, as every backend takes it: its impl, the per-layer constants its
    writer keeps (`AttentionKernels.layer_state`), this step's rows ([T, heads, head_size]; the first
    `num_tokens` are real), its cache and fp8 scales, and the output rows to write."""

    impl: AttentionImpl
    state: Any
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    kv_scales: torch.Tensor
    out: torch.Tensor
    num_tokens: int


class AttentionKernels(Protocol):
    """A backend: its name (logged and reported), which step classes of a layer it serves, and the
    per-layer constants it keeps (`layer_state`: None for none)."""

    name: str

    def unsupported(self, features: AttentionFeatures, step: StepClass) -> str | None:
        """Why this backend cannot serve `step` rows of a layer with `features`; None where it can."""
        ...

    def layer_state(self, impl: AttentionImpl, kv_cache: torch.Tensor, dtype: torch.dtype) -> Any: ...


class DecodeKernels(AttentionKernels, Protocol):
    """A backend of decode rows, which also stores each step's new keys and values of its layers."""

    # Whether its decode plan depends on the layer's window (blocks outside it are skipped).
    plans_per_window: bool

    def plan_decode(
        self, common: CommonAttentionMetadata, rows: DecodeRows, window: int, block_size: int, mixed: bool
    ) -> Any:
        """The step's decode plan, built once for every layer it serves; `mixed`: the step also
        has prompt segments."""
        ...

    def stores_kv(self, plan: Any) -> bool:
        """Whether `decode` with this plan stores the step's keys and values itself."""
        ...

    def plan_store(self, slots: torch.Tensor, block_size: int) -> Any: ...

    def write_kv(self, call: LayerCall, plan: Any) -> None:
        """Stores the step's `num_tokens` new keys and values in the layer's cache."""
        ...

    def decode(self, call: LayerCall, plan: Any) -> None:
        """Writes the attention of the plan's decode rows into their rows of `call.out`."""
        ...


class PromptKernels(AttentionKernels, Protocol):
    """A backend of prompt segments (their keys are stored in the cache before it runs)."""

    def plan_prompts(self, common: CommonAttentionMetadata, prefills: list[PrefillSegment]) -> Any: ...

    def prefill(
        self, call: LayerCall, block_tables: torch.Tensor, prefills: list[PrefillSegment], plan: Any
    ) -> None:
        """Writes the causal attention of each segment's rows into the same rows of `call.out`."""
        ...
