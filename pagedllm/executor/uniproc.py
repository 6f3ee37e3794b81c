"""One worker in the calling process: the executor for a single device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.executor.abstract import Executor, run_worker_method
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.driver_worker: Worker | None = self._make_worker()
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def _make_worker(self) -> Worker:
        return Worker(self.engine_config, rank=0, local_rank=0)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        if self.driver_worker is None:
            raise RuntimeError("the executor was shut down")
        return [run_worker_method(self.driver_worker, method, args, kwargs)]

    def shutdown(self) -> None:
        if self.driver_worker is not None:
            self.driver_worker.shutdown()
            self.driver_worker = None
