"""KV cache events: what routers (llm-d, Dynamo, the production stack) learn about the prefix cache.

The wire types mirror vLLM's `vllm.distributed.kv_events` field for field, so a subscriber written for
vLLM decodes them unchanged: an `EventBatch` is a positional msgpack array `[ts, events,
data_parallel_rank]`; each event is a msgpack map tagged by its class name under "type" (vLLM dropped
the positional encoding of events so that new fields can be appended without breaking subscribers).

Block hashes go out as vLLM publishes them by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the low
64 bits of the digest read as a big-endian unsigned int.

`KVEventRecorder` is the one place events are made: the block pool records the device pool's events
(medium "GPU", the name vLLM gives its primary pool on every platform, the CPU backend included), and
a secondary tier records its own with medium "CPU" or "DISK". The scheduler takes them once per step;
the engine core publishes them (pagedllm.distributed.kv_events: this package has no sockets).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from pagedllm.core.hashing import BlockHash

# A block hash as subscribers see it (vLLM's ExternalBlockHash: ints by default, raw bytes optionally).
ExternalBlockHash = bytes | int

# Storage media, as vLLM names them.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"

# Every layer of a pagedllm model shares one paged cache: one group of full-attention blocks.
_GROUP_IDX = 0
_SPEC_KIND = "full_attention"
_LOW_64_BITS = (1 << 64) - 1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class of the KV cache events (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    """A run of consecutive blocks of one sequence entered the cache; `parent_block_hash` is the hash
    of the block before the first one (None at the start of a sequence)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_block_hash(block_hash: BlockHash) -> int:
    """The published form of a block hash: its low 64 bits, big-endian (as vLLM's default)."""
    return int.from_bytes(block_hash, "big") & _LOW_64_BITS


class KVEventRecorder:
    """Collects the events of one cache (and of the tiers behind it) until the scheduler takes them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []

    def record_stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: tuple[Any, ...] | None = None,
        lora_id: int | None = None,
        medium: str = MEDIUM_GPU,
        block_size: int | None = None,
    ) -> None:
        """Blocks `block_hashes` (consecutive in one sequence, holding `token_ids`) are now cached in
        `medium`; `extra_keys` are the hash's extra keys, the same for each of these blocks. A tier
        whose blocks are larger than the cache's gives its own `block_size`."""
        if not block_hashes:
            return
        self._events.append(
            BlockStored(
                block_hashes=[external_block_hash(h) for h in block_hashes],
                parent_block_hash=None if parent_block_hash is None else external_block_hash(parent_block_hash),
                token_ids=list(token_ids),
                block_size=self.block_size if block_size is None else block_size,
                lora_id=lora_id,
                medium=medium,
                lora_name=None,
                extra_keys=[extra_keys] * len(block_hashes),
                group_idx=_GROUP_IDX,
                kv_cache_spec_kind=_SPEC_KIND,
            )
        )

    def record_removed(self, block_hashes: Sequence[BlockHash], medium: str = MEDIUM_GPU) -> None:
        """Blocks `block_hashes` are no longer cached in `medium`."""
        if block_hashes:
            self._events.append(
                BlockRemoved(
                    block_hashes=[external_block_hash(h) for h in block_hashes],
                    medium=medium,
                    group_idx=_GROUP_IDX,
                )
            )

    def record_all_cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events
