"""OffloadingConnector: a second tier for KV blocks the primary pool evicts (`kv_offloading_size` GiB,
`kv_offloading_backend="native"`, derived to this connector by the config as vLLM does).

Scheduler side: when the block pool evicts a cached block to reuse it, the tier takes a copy (unless it
holds that hash already), evicting its own least recently used block when full. When a request's local
prefix hit ends, the tier is asked for the following block hashes; a run of hits is loaded into the
request's new blocks, and the prefill of those tokens is skipped. The tier is inclusive: a block loaded
back stays in it, so evicting it again costs no copy.

Worker side: the step's copies start right after the step's states are applied (on CUDA on a background
thread, overlapping the input preparation; on the CPU inline, see `BackgroundJobs`) and are done before
the forward: first the evicted blocks into the tier (they are overwritten by this very forward), then
the hits into the pool (a slot refilled and loaded in the same step is therefore read after it is
written).

Hook points for KV cache events: `stored_listeners`, `removed_listeners` and `cleared_listeners` are
called with the block hashes the tier stores and drops, and when it is cleared.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.core.kv_events import MEDIUM_CPU, MEDIUM_DISK
from pagedllm.distributed.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorRole,
    elems_per_block,
    load_blocks,
    save_blocks,
)
from pagedllm.distributed.kv_transfer.tier_store import allocate_tier, num_tier_slots
from pagedllm.platforms import current_platform

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.block_pool import KVCacheBlock
    from pagedllm.core.hashing import BlockHash
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import Request
    from pagedllm.core.sched_output import SchedulerOutput
    from pagedllm.kv_cache_interface import KVCacheSpec

_EXTRA_KEYS = ("cpu_bytes_to_use", "disk_path")


@dataclass
class OffloadingMetadata:
    save_block_ids: list[int] = field(default_factory=list)
    save_slots: list[int] = field(default_factory=list)
    load_block_ids: list[int] = field(default_factory=list)
    load_slots: list[int] = field(default_factory=list)


class OffloadingConnector(KVConnectorBase):
    def __init__(
        self, engine_config: EngineConfig, role: KVConnectorRole, spec: KVCacheSpec, extra_config: Mapping[str, Any]
    ) -> None:
        super().__init__(engine_config, role, spec, extra_config)
        unknown = sorted(set(extra_config) - set(_EXTRA_KEYS))
        if unknown or "cpu_bytes_to_use" not in extra_config:
            raise ValueError(
                f"OffloadingConnector needs kv_connector_extra_config.cpu_bytes_to_use (set by kv_offloading_size); "
                f"unknown keys {unknown} (known: {', '.join(_EXTRA_KEYS)})"
            )
        self.num_slots = num_tier_slots(float(extra_config["cpu_bytes_to_use"]), spec.bytes_per_block)
        # Scheduler side: hash -> slot, least recently used first; slots never used yet; slots a lookup
        # or a load of this step relies on (never evicted before the step's copies ran).
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self._meta = OffloadingMetadata()
        self.stored_listeners: list[Callable[[list[BlockHash]], None]] = []
        self.removed_listeners: list[Callable[[list[BlockHash]], None]] = []
        self.cleared_listeners: list[Callable[[], None]] = []
        # Worker side: the tier's storage.
        self._store: torch.Tensor | None = None

    # ------------------------------------------------------------------ scheduler side
    def bind_scheduler(self, requests: Mapping[str, Request], kv_cache_manager: KVCacheManager) -> None:
        super().bind_scheduler(requests, kv_cache_manager)
        kv_cache_manager.block_pool.evicted_block_listeners.append(self._on_evict)
        events = kv_cache_manager.kv_events
        if events is not None:
            # The tier's blocks in KV cache events: host memory behind a CUDA pool, a file on the CPU.
            # Like vLLM's offloading events they carry the hashes only (no tokens, no parent).
            medium = MEDIUM_CPU if current_platform.is_cuda_alike() else MEDIUM_DISK
            self.stored_listeners.append(lambda hashes: events.record_stored(hashes, None, [], medium=medium))
            self.removed_listeners.append(lambda hashes: events.record_removed(hashes, medium=medium))

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, slot in self._slots.items():  # least recently used first
            if slot not in self._pinned:
                del self._slots[block_hash]
                for listener in self.removed_listeners:
                    listener([block_hash])
                return slot
        return None  # every slot is being loaded this step: this block is simply not kept

    def _on_evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._slots[block_hash] = slot
        self._meta.save_block_ids.append(block.block_id)
        self._meta.save_slots.append(slot)
        for listener in self.stored_listeners:
            listener([block_hash])

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        num_tokens = self._find_run(request, num_computed_tokens, self._slots.get)
        if num_tokens:
            # The allocation that follows may evict blocks into the tier: these slots must survive it.
            self._pinned.update(self._found[request.request_id][1])
        return num_tokens

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        found = self._take_found(request, num_external_tokens)
        if found is None:
            return
        start, slots = found
        self._meta.load_block_ids += block_ids[start : start + len(slots)]
        self._meta.load_slots += slots
        for block_hash in request.block_hashes[start : start + len(slots)]:
            self._slots.move_to_end(block_hash)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingMetadata:
        meta, self._meta = self._meta, OffloadingMetadata()
        self._pinned.clear()
        self._found.clear()
        return meta

    def reset_cache(self) -> None:
        self._slots.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        for listener in self.cleared_listeners:
            listener()

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._store = allocate_tier(
            self.num_slots,
            elems_per_block(self.spec),
            self.spec.dtype,
            kv_caches[0].device,
            self.extra_config.get("disk_path"),
        )

    def start_load_kv(self, metadata: OffloadingMetadata) -> None:
        if not (metadata.save_block_ids or metadata.load_block_ids):
            return
        assert self._jobs is not None and self._store is not None
        store = self._store

        def copy() -> None:
            start = time.perf_counter()
            if metadata.save_block_ids:
                save_blocks(self.kv_caches, metadata.save_block_ids, store, metadata.save_slots)
                self._count("bytes_saved", len(metadata.save_slots) * self.spec.bytes_per_block)
            saved = time.perf_counter()
            if metadata.load_block_ids:
                load_blocks(self.kv_caches, metadata.load_block_ids, store, metadata.load_slots)
                self._count("bytes_loaded", len(metadata.load_slots) * self.spec.bytes_per_block)
            self._count("save_time_s", saved - start)
            self._count("load_time_s", time.perf_counter() - saved)

        self._jobs.submit(copy)

    def shutdown(self) -> None:
        super().shutdown()
        self._store = None
