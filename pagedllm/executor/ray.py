"""The `ray` executor: one Ray actor per rank, in a placement group, on one machine or many.

The engine joins the Ray cluster it finds (`RAY_ADDRESS`, or the one `ray start --head` started on
this machine; without either Ray starts a local instance), reserves one bundle per rank (a GPU each
on CUDA, a CPU each otherwise) and starts a `RayWorker` actor in each. The actors form their process
groups over TCP at rank 0's node. Each call's arguments are put into Ray's object store once
(`ray.put`) and every actor reads the same object, so a step's scheduler output is serialized once,
as under `mp`. A dead actor surfaces as an error naming its rank as soon as Ray reports it; shutdown
kills the actors and removes the placement group.
"""

from __future__ import annotations

import logging
import socket
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm import envs
from pagedllm.distributed.parallel_state import output_rank
from pagedllm.executor.abstract import Executor, StepFuture, run_worker_method
from pagedllm.executor.multiproc import WorkerDiedError, free_tcp_port

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger("pagedllm.executor")

# Seconds to wait for the placement group's resources before giving up with an error.
_PLACEMENT_TIMEOUT = 120.0


class RayWorker:
    """The actor body: a `Worker` built on the actor's node, called by method name."""

    def __init__(self) -> None:
        self.worker: Any = None

    def node_address(self) -> tuple[str, int]:
        """This node's IP address and a free port on it (rank 0's is where the ranks meet)."""
        return socket.gethostbyname(socket.gethostname()), free_tcp_port()

    def start(
        self, engine_config: EngineConfig, rank: int, init_method: str, ranks_on_machine: int, omp_threads: int | None
    ) -> None:
        """`omp_threads`: the driver's OMP_NUM_THREADS (the user's choice) or None; without it a CPU rank
        takes its share of this machine's cores, as the other executors' ranks do."""
        from pagedllm.platforms import current_platform
        from pagedllm.worker.worker import Worker

        threads = omp_threads or max(1, current_platform.get_cpu_count() // ranks_on_machine)
        self.worker = Worker(
            engine_config, rank=rank, local_rank=0, distributed_init_method=init_method, cpu_threads=threads
        )
        self.worker.init_device()
        self.worker.load_model()

    def execute(self, method: str | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], reply: bool) -> Any:
        result = run_worker_method(self.worker, method, args, kwargs)
        return result if reply else None


class RayExecutor(Executor):
    def _init_executor(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pc = self.engine_config.parallel_config
        self.world_size: int = pc.world_size
        self.output_rank = output_rank(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        if not ray.is_initialized():
            # RAY_ADDRESS, else the cluster `ray start` started on this machine, else a new local one.
            ray.init(log_to_driver=False)
        on_gpu = str(self.engine_config.device_config.device).startswith("cuda")
        bundle = {"GPU": 1.0} if on_gpu else {"CPU": 1.0}
        self.pg: Any = placement_group([bundle] * self.world_size, strategy="PACK")
        self.actors: list[Any] = []
        try:
            ready, _ = ray.wait([self.pg.ready()], timeout=_PLACEMENT_TIMEOUT)
            if not ready:
                raise RuntimeError(
                    f"the Ray cluster did not provide {self.world_size} x {bundle} within {_PLACEMENT_TIMEOUT:.0f} s "
                    f"(cluster resources: {ray.cluster_resources()})"
                )
            actor_cls = ray.remote(num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0)(RayWorker)
            self.actors = [
                actor_cls.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
                ).remote()
                for i in range(self.world_size)
            ]
            addresses = ray.get([a.node_address.remote() for a in self.actors])
            host, port = addresses[0]
            init_method = f"tcp://{host}:{port}"
            # Ranks on one machine (one IP: also the nodes of a local test cluster) share its cores.
            per_machine = Counter(ip for ip, _ in addresses)
            omp = envs.OMP_NUM_THREADS
            omp_threads = int(omp) if omp else None
            self._wait(
                [
                    a.start.remote(self.engine_config, rank, init_method, per_machine[addresses[rank][0]], omp_threads)
                    for rank, a in enumerate(self.actors)
                ]
            )
        except BaseException:
            self.shutdown()
            raise
        logger.info("started %d Ray workers (placement group %s)", self.world_size, self.pg.id.hex())

    def _wait(self, refs: list[Any], timeout: float | None = None) -> list[Any]:
        """The results of `refs` (one per rank) in rank order; an error naming the first rank that died
        or failed, as soon as Ray reports it (without waiting for ranks blocked on the dead one)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not done:
                raise TimeoutError(f"Ray workers {sorted(rank_of[r] for r in pending)} did not answer in {timeout} s")
            rank = rank_of[done[0]]
            try:
                results[rank] = ray.get(done[0])
            except RayActorError as e:
                raise WorkerDiedError(f"Ray worker rank {rank} died: {e}") from None
            except RayTaskError as e:
                raise RuntimeError(f"Ray worker rank {rank} failed:\n{e}") from None
        return [results[r] for r in range(len(refs))]

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        return self._call(method, args, kwargs or {}, None, timeout)

    def _call(
        self, method: str | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], reply_rank: int | None, timeout: float | None
    ) -> list[Any]:
        return self._wait(self._submit(method, args, kwargs, reply_rank), timeout)

    def _submit(
        self, method: str | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], reply_rank: int | None
    ) -> list[Any]:
        """Start the call on every actor (each runs its calls in the order they were made); the refs."""
        import ray

        if not self.actors:
            raise RuntimeError("the executor was shut down")
        # Serialized once into the object store; every actor reads the same object.
        args_ref, kwargs_ref = ray.put(args), ray.put(kwargs)
        return [
            a.execute.remote(method, args_ref, kwargs_ref, reply_rank in (None, rank))
            for rank, a in enumerate(self.actors)
        ]

    def execute_model(self, scheduler_output: Any) -> None:
        self._call("execute_model", (scheduler_output,), {}, self.output_rank, None)

    def sample_tokens(self, grammar_output: Any) -> Any:
        return self._call("sample_tokens", (grammar_output,), {}, self.output_rank, None)[self.output_rank]

    def submit_step(self, scheduler_output: Any, grammar_output: Any) -> StepFuture:
        execute_refs = self._submit("execute_model", (scheduler_output,), {}, self.output_rank)
        sample_refs = self._submit("sample_tokens", (grammar_output,), {}, self.output_rank)

        def read(future: StepFuture) -> None:
            try:
                self._wait(execute_refs)
                future.set_result(self._wait(sample_refs)[self.output_rank])
            except BaseException as e:
                future.set_exception(e)

        return StepFuture(read)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        actors, self.actors = self.actors, []
        for actor in actors:
            ray.kill(actor)
        if getattr(self, "pg", None) is not None:
            remove_placement_group(self.pg)
            self.pg = None
