"""What the scheduler calls on a KV connector's scheduler side (offloading tier, shared storage), in
the order it calls it; `pagedllm.distributed.kv_transfer.KVConnectorBase` implements it. A protocol
here so that core/ names no connector (they sit above it and read its requests and cache manager)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import Request
    from pagedllm.core.sched_output import SchedulerOutput


class SchedulerConnector(Protocol):
    def bind_scheduler(self, requests: Mapping[str, Request], kv_cache_manager: KVCacheManager) -> None: ...

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int: ...

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None: ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any: ...

    def request_finished(self, request: Request) -> None: ...

    def reset_cache(self) -> None: ...
