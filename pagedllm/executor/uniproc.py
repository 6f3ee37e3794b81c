"""One worker in the calling process: the executor for a single device."""

from __future__ import annotations

from pagedllm.core.runner_output import ModelRunnerOutput
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.worker.kv_cache import KVCacheSpec
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.driver_worker: Worker | None = Worker(self.engine_config, rank=0, local_rank=0)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    @property
    def worker(self) -> Worker:
        if self.driver_worker is None:
            raise RuntimeError("the executor was shut down")
        return self.driver_worker

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return self.worker.get_kv_cache_spec()

    def determine_available_kv_cache_bytes(self) -> int:
        return self.worker.determine_available_kv_cache_bytes()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def compile_or_warm_up_model(self) -> None:
        self.worker.compile_or_warm_up_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.driver_worker is not None:
            self.driver_worker.shutdown()
            self.driver_worker = None
