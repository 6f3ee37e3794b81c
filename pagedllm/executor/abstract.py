"""The executor interface: how the engine core reaches its workers.

The core calls worker methods by name through `collective_rpc` (every worker runs the call; the
results come back in rank order), so a new worker capability needs no new executor method.

`Executor.get_class(engine_config)` picks the implementation from
`parallel_config.distributed_executor_backend`; backends that do not exist yet fail there, at engine
start-up, with a message naming the option.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

from pagedllm.core.runner_output import ModelRunnerOutput
from pagedllm.core.sched_output import GrammarOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import max_concurrent_batches

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig


def run_worker_method(
    worker: Any, method: str | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> Any:
    """`worker.method(*args, **kwargs)`, or `method(worker, *args, **kwargs)` for a function."""
    call = getattr(worker, method) if isinstance(method, str) else partial(method, worker)
    return call(*args, **(kwargs or {}))


class StepFuture(Future[ModelRunnerOutput]):
    """A step the workers run in the background (`Executor.submit_step`). Nothing completes it on
    its own: `result()` reads the workers' answers, those of the steps started before it first."""

    def __init__(self, read_until: Callable[[StepFuture], None]) -> None:
        super().__init__()
        self._read_until = read_until

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        if not self.done():
            self._read_until(self)
        return super().result(timeout)


class Executor(ABC):
    # Whether two batches can be in flight at once (async scheduling overlaps step N+1's scheduling
    # with step N's execution). Mirrored in pagedllm.config.parallel.EXECUTOR_SUPPORTS_ASYNC, which
    # config construction reads without importing the executors.
    _supports_async_scheduling: ClassVar[bool] = False

    @staticmethod
    def get_class(engine_config: EngineConfig) -> type[Executor]:
        backend = engine_config.parallel_config.distributed_executor_backend
        if backend in (None, "uni"):
            world = engine_config.parallel_config.world_size
            if world != 1:
                raise ValueError(
                    f"distributed_executor_backend='uni' runs one worker, but the parallel config needs "
                    f"{world} (tensor_parallel_size x pipeline_parallel_size): use 'mp' or 'ray'"
                )
            from pagedllm.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from pagedllm.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            from pagedllm.executor.ray import RayExecutor

            return RayExecutor
        if backend == "external_launcher":
            from pagedllm.executor.external_launcher import ExternalLauncherExecutor

            return ExternalLauncherExecutor
        raise ValueError(
            f"distributed_executor_backend={backend!r} is not supported; the executors are 'uni' (one "
            "worker in the engine core's process), 'mp' (a process per rank), 'ray' (Ray actors) and "
            "'external_launcher' (torchrun starts the ranks)"
        )

    @staticmethod
    def worker_method(name: str) -> Callable[..., Any] | None:
        """The workers' method `name` (None: no such method), for checking a call's arguments before
        it is sent: in a worker process a mismatch would come back as that worker's failure."""
        # Imported here: the worker pulls in the models and the attention backends, which config
        # construction (reading `get_class`) does not need.
        from pagedllm.worker.worker import Worker

        method = getattr(Worker, name, None)
        return method if callable(method) else None

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return cls._supports_async_scheduling

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and load the model on them."""

    @abstractmethod
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call the worker method named ``method`` (or the function ``method(worker, *args)``) on
        every worker; their results in rank order.

        ``timeout`` (seconds) bounds the wait for workers in other processes; an in-process worker
        runs the call to completion."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Run the step's forward (the workers keep its state until `sample_tokens`)."""
        self.collective_rpc("execute_model", args=(scheduler_output,))

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample the step run by `execute_model`, under the grammar's bitmask when there is one."""
        return self.collective_rpc("sample_tokens", args=(grammar_output,))[0]

    def submit_step(self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None) -> StepFuture:
        """Start a whole step (`execute_model`, then `sample_tokens` under ``grammar_output``) and return
        at once; the workers run the steps in the order they were submitted. For executors whose
        `max_concurrent_batches` is above one (pipeline parallelism: `mp` and `ray`)."""
        raise NotImplementedError(f"{type(self).__name__} runs one batch at a time")

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    def max_concurrent_batches(self) -> int:
        """Batches the engine keeps in flight: one per pipeline stage under `mp` and `ray`."""
        if self.supports_async_scheduling():
            return 2
        return max_concurrent_batches(self.engine_config.parallel_config)
