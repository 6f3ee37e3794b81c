"""Data parallelism behind one API server: N engine core processes, one front-end.

`pagedllm serve --data-parallel-size N` starts N engine cores (each an `AsyncMPClient` with its own
process, scheduler, KV cache and executor) and `DPAsyncMPClient` stands in for the one client that
`AsyncLLM` talks to. Each new request goes to one core (`LoadBalancer`: the least loaded, with
prefix-cache affinity as the tie-break), its aborts follow it there, engine operations (sleep, LoRA,
prefix-cache reset, collective RPCs, ...) go to every core, and the outputs of all cores arrive in one
queue, each tagged with its core's data parallel rank (`EngineCoreOutputs.engine_index`).

The cores run independently (dense models need no lockstep between replicas): nothing crosses between
them, only between each core and the front-end. The death of any core is the death of the engine, as
with one core: every request in flight fails with `EngineDeadError` naming the core, the server answers
503 and exits, and the other cores are stopped with it.
"""

from __future__ import annotations

import asyncio
import copy
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from pagedllm import envs
from pagedllm.engine.core_client import STARTUP_TIMEOUT_S, AsyncMPClient, EngineCoreProcess, EngineDeadError
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreRequest

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from pagedllm.config import EngineConfig

# vLLM's load score: a waiting request weighs four running ones (it still needs its whole prefill).
WAITING_WEIGHT = 4
# Prompt prefixes remembered for the affinity tie-break (least recently used ones are forgotten).
_AFFINITY_ENTRIES = 8192


class LoadBalancer:
    """Chooses the engine core of each new request from the requests this front-end has in flight.

    A core's load is ``waiting * 4 + running`` (vLLM's score), counted here: a request is waiting from
    its dispatch until its first output, then running until it finishes or is aborted. Between cores of
    equal load, the one that last served a prompt with the same first KV block wins: its prefix cache
    may still hold that block (and every block after it the prompts share)."""

    def __init__(self, num_engines: int, block_size: int) -> None:
        self.num_engines = num_engines
        self.block_size = block_size
        self.waiting = [0] * num_engines
        self.running = [0] * num_engines
        # request id -> (its core, whether it has produced output yet)
        self._requests: dict[str, tuple[int, bool]] = {}
        self._affinity: OrderedDict[Hashable, int] = OrderedDict()

    def load(self, index: int) -> int:
        return self.waiting[index] * WAITING_WEIGHT + self.running[index]

    def _prefix_key(self, request: EngineCoreRequest) -> Hashable | None:
        # Only a full block is cached; the adapter is part of the cache key (an adapter's KV differs).
        if len(request.prompt_token_ids) < self.block_size:
            return None
        lora = request.lora_request.lora_int_id if request.lora_request is not None else 0
        return (lora, tuple(request.prompt_token_ids[: self.block_size]))

    def choose(self, request: EngineCoreRequest) -> int:
        """The core for a new request (it is not counted until `assign`)."""
        loads = [self.load(i) for i in range(self.num_engines)]
        least = min(loads)
        key = self._prefix_key(request)
        preferred = self._affinity.get(key) if key is not None else None
        if preferred is not None and loads[preferred] == least:
            return preferred
        return loads.index(least)

    def assign(self, request: EngineCoreRequest, index: int) -> None:
        """Count a request sent to core ``index`` (waiting) and remember its prompt prefix there."""
        self._requests[request.request_id] = (index, False)
        self.waiting[index] += 1
        key = self._prefix_key(request)
        if key is not None:
            self._affinity[key] = index
            self._affinity.move_to_end(key)
            if len(self._affinity) > _AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)

    def started(self, request_id: str) -> None:
        """The request produced output: it runs."""
        entry = self._requests.get(request_id)
        if entry is None or entry[1]:
            return
        index = entry[0]
        self._requests[request_id] = (index, True)
        self.waiting[index] -= 1
        self.running[index] += 1

    def finished(self, request_id: str) -> None:
        """The request finished or was aborted: it no longer loads its core."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        index, started = entry
        if started:
            self.running[index] -= 1
        else:
            self.waiting[index] -= 1

    def owner(self, request_id: str) -> int | None:
        entry = self._requests.get(request_id)
        return None if entry is None else entry[0]

    def observe(self, outputs: EngineCoreOutputs) -> None:
        """Update the counts from one batch of a core's outputs."""
        for output in outputs.outputs:
            if output.finish_reason is not None:
                self.finished(output.request_id)
            else:
                self.started(output.request_id)
        for request_id in outputs.errors:
            self.finished(request_id)


def core_config(engine_config: EngineConfig, index: int) -> EngineConfig:
    """The configuration of data parallel rank ``index``: the server's, with the rank set."""
    config = copy.deepcopy(engine_config)
    config.parallel_config.data_parallel_index = index
    return config


def core_environ(engine_config: EngineConfig, index: int) -> dict[str, str]:
    """The devices of data parallel rank ``index`` on CUDA: its own `world_size` GPUs (on the CPU every
    core shares the machine's cores)."""
    from pagedllm.platforms import current_platform

    if not current_platform.is_cuda():
        return {}
    import torch

    pc = engine_config.parallel_config
    visible = envs.CUDA_VISIBLE_DEVICES
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    needed = pc.data_parallel_size * pc.world_size
    if len(devices) < needed:
        raise ValueError(
            f"data_parallel_size={pc.data_parallel_size} with {pc.world_size} GPU(s) per engine core needs "
            f"{needed} GPUs; {len(devices)} are visible"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices[index * pc.world_size : (index + 1) * pc.world_size])}


class DPAsyncMPClient:
    """`AsyncMPClient`'s interface over several engine cores (create it with `await DPAsyncMPClient.start`)."""

    def __init__(
        self,
        clients: Sequence[AsyncMPClient],
        outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError],
        block_size: int,
    ) -> None:
        self.clients = list(clients)
        self._outputs = outputs
        self.balancer = LoadBalancer(len(self.clients), block_size)

    @classmethod
    async def start(
        cls,
        engine_config: EngineConfig,
        core_process: EngineCoreProcess | None = None,
        startup_timeout: float = STARTUP_TIMEOUT_S,
    ) -> DPAsyncMPClient:
        """Start `data_parallel_size` cores (rank 0 in `core_process` if one was started early) and wait
        until all are ready; if one fails, all are stopped."""
        size = engine_config.parallel_config.data_parallel_size
        outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] = asyncio.Queue()
        processes = [core_process or EngineCoreProcess()] + [EngineCoreProcess() for _ in range(size - 1)]
        clients: list[AsyncMPClient] = []
        try:
            for index, process in enumerate(processes):
                environ = core_environ(engine_config, index)
                clients.append(AsyncMPClient(core_config(engine_config, index), process, outputs, environ))
        except BaseException:
            _shutdown(clients)
            for process in processes[len(clients) :]:
                process.stop()
            raise
        waits = [asyncio.ensure_future(client.wait_started(startup_timeout)) for client in clients]
        try:
            await asyncio.gather(*waits)
        except BaseException:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
            _shutdown(clients)
            raise
        return cls(clients, outputs, engine_config.cache_config.block_size)

    # --------------------------------------------------------------------------------------- health
    @property
    def dead_error(self) -> EngineDeadError | None:
        return next((c.dead_error for c in self.clients if c.dead_error is not None), None)

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def processes(self) -> list[BaseProcess]:
        return [client.process for client in self.clients]

    def _ensure_alive(self) -> None:
        error = self.dead_error
        if error is not None:
            raise error

    # ------------------------------------------------------------------------------------ requests
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_alive()
        index = self.balancer.choose(request)
        self.balancer.assign(request, index)
        try:
            await self.clients[index].add_request_async(request)
        except BaseException:
            self.balancer.finished(request.request_id)
            raise

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        by_core: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self.balancer.owner(request_id)
            if index is not None:
                by_core.setdefault(index, []).append(request_id)
                self.balancer.finished(request_id)
        await asyncio.gather(*(self.clients[i].abort_requests_async(ids) for i, ids in by_core.items()))

    def engine_index_of(self, request_id: str) -> int:
        """The data parallel rank of the core serving a request (0 once it is no longer in flight)."""
        index = self.balancer.owner(request_id)
        return 0 if index is None else index

    async def call_utility_async(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run an engine operation on every core (they must stay alike: same adapters, same sleep
        state, same weights); the result is rank 0's, as in vLLM."""
        self._ensure_alive()
        results = await asyncio.gather(*(c.call_utility_async(method, *args, **kwargs) for c in self.clients))
        return results[0]

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next outputs of any core; raises EngineDeadError once one of them is gone."""
        self._ensure_alive()
        item = await self._outputs.get()
        if isinstance(item, EngineDeadError):
            self._outputs.put_nowait(item)
            raise item
        self.balancer.observe(item)
        return item

    def shutdown(self) -> None:
        _shutdown(self.clients)


def _shutdown(clients: Sequence[AsyncMPClient]) -> None:
    # SIGTERM to every core first, so that they wind down together rather than one after the other.
    for client in clients:
        client.terminate()
    for client in clients:
        client.shutdown()


async def start_core_client(
    engine_config: EngineConfig, core_process: EngineCoreProcess | None = None
) -> AsyncMPClient | DPAsyncMPClient:
    """The client of the server's engine: one core, or one per data parallel rank (internal load
    balancing; in external-LB mode this server runs its one rank)."""
    pc = engine_config.parallel_config
    if pc.data_parallel_size > 1 and not pc.data_parallel_external_lb:
        return await DPAsyncMPClient.start(engine_config, core_process)
    return await AsyncMPClient.start(engine_config, core_process)
