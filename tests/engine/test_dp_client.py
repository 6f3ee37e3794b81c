"""The data parallel front-end without a model: its routing rule (least loaded core first, a waiting
request weighing four running ones, prefix-cache affinity between equally loaded cores), aborts to the
owning core, operations to every core."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.dp_client import WAITING_WEIGHT, DPAsyncMPClient, LoadBalancer
from pagedllm.engine.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from pagedllm.errors import ErrorReport
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams

BLOCK = 4


def _request(request_id: str, prompt: list[int], lora: LoRARequest | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=4), None, lora_request=lora)


def _dispatch(balancer: LoadBalancer, request: EngineCoreRequest) -> int:
    index = balancer.choose(request)
    balancer.assign(request, index)
    return index


def test_new_requests_spread_over_idle_cores() -> None:
    balancer = LoadBalancer(3, BLOCK)
    cores = [_dispatch(balancer, _request(f"r{i}", [i] * 8)) for i in range(6)]
    assert cores == [0, 1, 2, 0, 1, 2]
    assert [balancer.load(i) for i in range(3)] == [2 * WAITING_WEIGHT] * 3


def test_waiting_weighs_four_running() -> None:
    balancer = LoadBalancer(2, BLOCK)
    # Core 0: four running requests (load 4); core 1: one waiting request (load 4), then two (load 8).
    for i in range(4):
        balancer.assign(_request(f"a{i}", [1, 2]), 0)
        balancer.started(f"a{i}")
    balancer.assign(_request("b0", [3, 4]), 1)
    assert balancer.load(0) == balancer.load(1) == 4
    balancer.assign(_request("b1", [3, 4]), 1)
    assert balancer.choose(_request("new", [5])) == 0
    # A fifth running request on core 0 still weighs less than core 1's two waiting ones.
    balancer.assign(_request("a4", [1]), 0)
    balancer.started("a4")
    assert balancer.choose(_request("new", [5])) == 0
    # Once core 1's requests run, it is the lighter one.
    balancer.started("b0")
    balancer.started("b1")
    assert balancer.choose(_request("new", [5])) == 1


def test_prefix_affinity_breaks_ties_only() -> None:
    balancer = LoadBalancer(2, BLOCK)
    shared = [7, 7, 7, 7, 1, 2]
    assert _dispatch(balancer, _request("first", shared)) == 0
    balancer.finished("first")
    # Both idle: a filler lands on core 0 and finishes; the shared prefix still prefers core 0.
    other = _dispatch(balancer, _request("filler", [9] * 8))
    assert other == 0
    balancer.finished("filler")
    assert balancer.choose(_request("again", [7, 7, 7, 7, 5])) == 0
    # Core 1 served it last: now core 1 is preferred while the loads are equal...
    balancer.assign(_request("moved", shared), 1)
    balancer.finished("moved")
    assert balancer.choose(_request("again", shared)) == 1
    # ...but never over a less loaded core.
    balancer.assign(_request("busy", [3] * 8), 1)
    assert balancer.choose(_request("again", shared)) == 0


def test_affinity_needs_a_full_block_and_the_same_adapter() -> None:
    balancer = LoadBalancer(2, BLOCK)
    balancer.assign(_request("short", [7, 7, 7]), 1)
    balancer.finished("short")
    assert balancer.choose(_request("x", [7, 7, 7])) == 0  # shorter than a block: nothing cached
    balancer.assign(_request("base", [8] * 8), 1)
    balancer.finished("base")
    assert balancer.choose(_request("x", [8] * 8)) == 1
    adapter = LoRARequest("sql", 1, "/nowhere")
    assert balancer.choose(_request("x", [8] * 8, lora=adapter)) == 0


def test_outputs_and_aborts_release_load() -> None:
    balancer = LoadBalancer(2, BLOCK)
    for token, name in enumerate(("a", "b", "c")):
        _dispatch(balancer, _request(name, [token] * 8))
    assert (balancer.owner("a"), balancer.owner("b"), balancer.owner("c")) == (0, 1, 0)
    balancer.observe(EngineCoreOutputs([EngineCoreOutput("a", [5]), EngineCoreOutput("b", [6])]))
    assert (balancer.load(0), balancer.load(1)) == (1 + WAITING_WEIGHT, 1)
    balancer.observe(
        EngineCoreOutputs(
            [EngineCoreOutput("a", [5], finish_reason=FinishReason.LENGTH)], errors={"b": ErrorReport("bad")}
        )
    )
    assert (balancer.load(0), balancer.load(1)) == (WAITING_WEIGHT, 0)
    balancer.finished("c")  # aborted while waiting
    balancer.finished("c")  # a second abort changes nothing
    assert (balancer.load(0), balancer.load(1)) == (0, 0)
    assert balancer.owner("c") is None


class _FakeCore:
    """Stands in for one core's AsyncMPClient: records what reaches it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.dead_error: EngineDeadError | None = None

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.added.append(request.request_id)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self.calls.append((method, args))
        return f"core {self.index}"


def test_client_routes_aborts_to_the_owner_and_operations_to_every_core() -> None:
    async def scenario() -> None:
        cores = [_FakeCore(0), _FakeCore(1)]
        outputs: asyncio.Queue[Any] = asyncio.Queue()
        client = DPAsyncMPClient(cores, outputs, BLOCK)  # type: ignore[arg-type]
        for token, name in enumerate(("a", "b", "c")):
            await client.add_request_async(_request(name, [token] * 8))
        assert (cores[0].added, cores[1].added) == (["a", "c"], ["b"])
        assert client.engine_index_of("b") == 1
        await client.abort_requests_async(["b", "c", "unknown"])
        assert (cores[0].aborted, cores[1].aborted) == (["c"], ["b"])
        assert await client.call_utility_async("reset_prefix_cache") == "core 0"
        assert [c.calls for c in cores] == [[("reset_prefix_cache", ())]] * 2
        # Outputs of any core reach the one reader and update the loads.
        outputs.put_nowait(EngineCoreOutputs([EngineCoreOutput("a", [1])], engine_index=0))
        assert (await client.get_output_async()).engine_index == 0
        assert client.balancer.load(0) == 1
        # One dead core is the engine's death, named after that core.
        cores[1].dead_error = EngineDeadError("Engine core 1 (data parallel rank 1, pid 7) died")
        assert client.is_dead
        with pytest.raises(EngineDeadError, match="Engine core 1"):
            await client.add_request_async(_request("d", [9] * 8))

    asyncio.run(scenario())
