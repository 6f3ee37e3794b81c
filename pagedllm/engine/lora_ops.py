"""The EngineCore's LoRA adapter operations (vLLM's `add_lora` / `remove_lora` / `list_loras`),
reached by front-ends through `call_utility` and run between two steps.

`add_lora` reads and checks the adapter in the worker (path, shapes against the base model, rank
against `max_lora_rank`): a front-end calls it before the first request of an adapter, so a bad
adapter fails that request with a clear error instead of a step. `remove_lora` refuses an adapter that
an unfinished request uses: running requests are never disturbed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from pagedllm.lora.request import LoRARequest

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.executor import Executor


class LoRAOps:
    """Mixed into EngineCore (which provides the executor and the scheduler)."""

    model_executor: Executor
    scheduler: Scheduler
    engine_config: EngineConfig

    def _require_lora(self) -> None:
        if self.engine_config.lora_config is None:
            raise ValueError("LoRA is not enabled (enable_lora=True, or --enable-lora)")

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load the adapter into the workers' memory; False if it was loaded already."""
        self._require_lora()
        if not isinstance(lora_request, LoRARequest):  # over ZMQ it arrives as its msgpack array
            lora_request = msgspec.convert(lora_request, LoRARequest)
        return bool(self.model_executor.collective_rpc("add_lora", args=(lora_request,))[0])

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget the adapter; ValueError while an unfinished request uses it."""
        self._require_lora()
        users = sum(1 for r in self.scheduler.requests.values() if r.lora_int_id == lora_int_id)
        if users:
            raise ValueError(f"LoRA adapter {lora_int_id} is in use by {users} unfinished requests")
        return bool(self.model_executor.collective_rpc("remove_lora", args=(lora_int_id,))[0])

    def list_loras(self) -> list[int]:
        self._require_lora()
        return list(self.model_executor.collective_rpc("list_loras")[0])
