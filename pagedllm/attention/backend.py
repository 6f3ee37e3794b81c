"""The attention backend interface: one metadata object for a flattened mixed batch.

The batch is the concatenation of every scheduled request's new tokens (no padding). Request ``i`` owns
query rows ``query_start_loc[i]:query_start_loc[i+1]``; its keys are the ``seq_lens[i]`` tokens
``0..seq_lens[i]-1`` of its sequence, of which the first ``num_computed_tokens[i]`` are already in the KV
cache (a cached prefix or earlier chunks) and the rest are this step's tokens, written to the cache at
``slot_mapping`` before attention. Causal masking is per request: query token ``j`` (absolute position
``num_computed_tokens[i] + j``) sees keys ``0..num_computed_tokens[i] + j``.

KV cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (key, value).
Slot ``s`` is block ``s // block_size``, offset ``s % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

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
