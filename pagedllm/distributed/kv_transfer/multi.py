"""MultiConnector: several connectors chained (vLLM's), e.g. the offloading tier plus shared storage.

`kv_connector_extra_config = {"connectors": [{"kv_connector": ..., "kv_connector_extra_config": {...}},
...]}`. Loads come from the first connector (in that order) that has a hit for a request; every
connector sees every step and saves what it saves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.distributed.kv_transfer.base import KVConnectorBase, KVConnectorRole
from pagedllm.distributed.kv_transfer.factory import make_connector

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import Request
    from pagedllm.core.sched_output import SchedulerOutput
    from pagedllm.kv_cache_interface import KVCacheSpec


class MultiConnector(KVConnectorBase):
    def __init__(
        self, engine_config: EngineConfig, role: KVConnectorRole, spec: KVCacheSpec, extra_config: Mapping[str, Any]
    ) -> None:
        super().__init__(engine_config, role, spec, extra_config)
        subs = extra_config.get("connectors")
        if not isinstance(subs, list) or not subs:
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config.connectors must list the MultiConnector's "
                'connectors, e.g. [{"kv_connector": "SharedStorageConnector"}]'
            )
        self.connectors: list[KVConnectorBase] = []
        for sub in subs:
            name = sub.get("kv_connector")
            if name == "MultiConnector" or not isinstance(name, str):
                raise ValueError(
                    f"MultiConnector: each entry needs a kv_connector name (not nested), got {sub!r}"
                )
            self.connectors.append(
                make_connector(name, engine_config, role, spec, sub.get("kv_connector_extra_config", {}))
            )
        # req_id -> index of the connector whose hit the request was admitted with.
        self._chosen: dict[str, int] = {}

    def bind_scheduler(self, requests: Mapping[str, Request], kv_cache_manager: KVCacheManager) -> None:
        for c in self.connectors:
            c.bind_scheduler(requests, kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        self._chosen.pop(request.request_id, None)
        for i, c in enumerate(self.connectors):
            n = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if n > 0:
                self._chosen[request.request_id] = i
                return n
        return 0

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        chosen = self._chosen.pop(request.request_id, None)
        for i, c in enumerate(self.connectors):
            c.update_state_after_alloc(request, block_ids, num_external_tokens if i == chosen else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        return [c.build_connector_meta(scheduler_output) for c in self.connectors]

    def request_finished(self, request: Request) -> None:
        self._chosen.pop(request.request_id, None)
        for c in self.connectors:
            c.request_finished(request)

    def reset_cache(self) -> None:
        for c in self.connectors:
            c.reset_cache()

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        for c in self.connectors:
            c.register_kv_caches(kv_caches)

    def start_load_kv(self, metadata: Any) -> None:
        for c, m in zip(self.connectors, metadata):
            c.start_load_kv(m)

    def wait_for_load(self) -> None:
        for c in self.connectors:
            c.wait_for_load()

    def save_kv(self, metadata: Any) -> None:
        for c, m in zip(self.connectors, metadata):
            c.save_kv(m)

    def wait_for_save(self) -> None:
        for c in self.connectors:
            c.wait_for_save()

    def take_stats(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for c in self.connectors:
            for key, value in c.take_stats().items():
                total[key] = total.get(key, 0.0) + value
        return total

    def shutdown(self) -> None:
        for c in self.connectors:
            c.shutdown()
