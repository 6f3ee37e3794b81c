"""The executor interface: how the engine core reaches its workers.

`Executor.get_class(engine_config)` picks the implementation from
`parallel_config.distributed_executor_backend`; backends that do not exist yet fail there, at engine
start-up, with a message naming the option.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from pagedllm.core.runner_output import ModelRunnerOutput
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.worker.kv_cache import KVCacheSpec


class Executor(ABC):
    # Whether two batches can be in flight at once (async scheduling overlaps step N+1's scheduling
    # with step N's execution). Mirrored in pagedllm.config.parallel.EXECUTOR_SUPPORTS_ASYNC, which
    # config construction reads without importing the executors.
    _supports_async_scheduling: ClassVar[bool] = False

    @staticmethod
    def get_class(engine_config: Any) -> type[Executor]:
        backend = engine_config.parallel_config.distributed_executor_backend
        if backend in (None, "uni"):
            world = engine_config.parallel_config.world_size
            if world != 1:
                raise ValueError(
                    f"distributed_executor_backend='uni' runs one worker, but the parallel config needs "
                    f"{world} (tensor_parallel_size x pipeline_parallel_size); multi-worker execution is not "
                    "supported yet"
                )
            from pagedllm.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        raise ValueError(
            f"distributed_executor_backend={backend!r} is not supported yet; the only executor is 'uni' "
            "(one worker in the engine core's process)"
        )

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return cls._supports_async_scheduling

    def __init__(self, engine_config: Any) -> None:
        self.engine_config = engine_config
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and load the model on them."""

    @abstractmethod
    def get_kv_cache_spec(self) -> KVCacheSpec: ...

    @abstractmethod
    def determine_available_kv_cache_bytes(self) -> int:
        """The KV cache byte budget (the minimum over workers)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def compile_or_warm_up_model(self) -> None:
        """Compile the forward for every shape class before the first request."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    def max_concurrent_batches(self) -> int:
        return 2 if self.supports_async_scheduling() else 1
