"""The engine core in its own process: handshake, requests over ZMQ, aborts, death detection, shutdown."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import psutil
import pytest

from pagedllm.config.args import EngineArgs
from pagedllm.engine import core_proc
from pagedllm.engine.core_client import AsyncMPClient, EngineCoreProcess, EngineDeadError
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreRequest
from pagedllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def _config(**overrides: object):  # type: ignore[no-untyped-def]
    args = {"max_model_len": 256, "optimization_level": 0, "kv_cache_memory_bytes": 32 * 2**20, **overrides}
    return EngineArgs(**args).create_engine_config()


def _request(request_id: str, max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id, [1, 504, 3458, 282], params, eos_token_id=2)


async def _collect(client: AsyncMPClient, until_finished: set[str]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while until_finished:
        outputs: EngineCoreOutputs = await asyncio.wait_for(client.get_output_async(), 60)
        for output in outputs.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                until_finished.discard(output.request_id)
    return tokens


def test_requests_aborts_and_death() -> None:
    async def scenario() -> None:
        client = await AsyncMPClient.start(_config())
        try:
            assert client.startup_info is not None and client.startup_info.num_gpu_blocks
            await client.add_request_async(_request("a", 5))
            await client.add_request_async(_request("b", 3))
            tokens = await _collect(client, {"a", "b"})
            assert len(tokens["a"]) == 5 and len(tokens["b"]) == 3
            # Greedy and the same prompt: the shorter output is a prefix of the longer one.
            assert tokens["a"][:3] == tokens["b"]

            # An aborted request stops producing and the core reports idle stats (no blocks in use).
            await client.add_request_async(_request("long", 200))
            await _first_output(client, "long")
            await client.abort_requests_async(["long"])
            while True:
                outputs = await asyncio.wait_for(client.get_output_async(), 60)
                stats = outputs.scheduler_stats
                if stats is not None and stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0:
                    break

            # A request the core refuses (longer than the context) fails alone.
            too_long = EngineCoreRequest(
                "x", list(range(10, 300)), SamplingParams(max_tokens=1), eos_token_id=2
            )
            await client.add_request_async(too_long)
            while True:
                outputs = await asyncio.wait_for(client.get_output_async(), 60)
                if outputs.errors:
                    # The refusal crossed the process boundary with the field it is about.
                    assert outputs.errors["x"].param == "prompt"
                    assert "290 tokens" in outputs.errors["x"].message
                    break

            # kill -9 of the core: noticed at once, every call fails with EngineDeadError.
            os.kill(client.process.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="killed by signal 9"):
                # Outputs sent before the kill may still be queued ahead of the error.
                while True:
                    await asyncio.wait_for(client.get_output_async(), 30)
            with pytest.raises(EngineDeadError):
                await client.add_request_async(_request("c", 1))
            assert client.is_dead
        finally:
            client.shutdown()
        assert not client.process.is_alive()

    asyncio.run(scenario())


def test_core_process_started_early_then_launched() -> None:
    # Launched before it finished its preloading (the O0 configuration needs no compiler), then one
    # launched with the compiler stack already imported: both serve.
    for settle_s in (0.0, 10.0):

        async def scenario(core: EngineCoreProcess) -> None:
            client = await AsyncMPClient.start(_config(), core)
            try:
                assert client.process is core.process
                await client.add_request_async(_request("a", 4))
                assert len((await _collect(client, {"a"}))["a"]) == 4
            finally:
                client.shutdown()
            assert not core.process.is_alive()

        core = EngineCoreProcess()
        time.sleep(settle_s)
        asyncio.run(scenario(core))


def test_launch_carries_the_environment_of_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Building the configuration may set variables after the process was spawned: they must reach it.
    core = EngineCoreProcess.__new__(EngineCoreProcess)
    receiver, core._sender = multiprocessing.Pipe(duplex=False)
    monkeypatch.setenv("PAGEDLLM_TEST_SET_AFTER_SPAWN", "1")
    config = _config()
    core.launch(config, "ipc://input", "ipc://output")
    launch = receiver.recv()
    assert launch.environ["PAGEDLLM_TEST_SET_AFTER_SPAWN"] == "1"
    assert launch.parent_pid == os.getpid() and launch.input_addr == "ipc://input"
    assert launch.engine_config.compute_hash() == config.compute_hash()


def test_a_failing_preload_step_is_skipped_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    done: list[str] = []

    def fails() -> None:
        raise ImportError("a torch without this internal")

    monkeypatch.setattr(
        core_proc, "_PRELOAD_STEPS", (lambda: done.append("first"), fails, lambda: done.append("x"))
    )
    receiver, sender = multiprocessing.Pipe(duplex=False)
    core_proc._preload(receiver)  # no launch yet: runs steps until one fails
    assert done == ["first"]

    # Once the launch is waiting, no step runs.
    done.clear()
    sender.send("launch")
    core_proc._preload(receiver)
    assert done == []


def test_unlaunched_core_process_stops() -> None:
    core = EngineCoreProcess()
    core.stop()
    assert not core.process.is_alive() and core.process.exitcode is not None
    core.stop()  # a second stop is a no-op


async def _first_output(client: AsyncMPClient, request_id: str) -> None:
    while True:
        outputs = await asyncio.wait_for(client.get_output_async(), 60)
        if any(o.request_id == request_id and o.new_token_ids for o in outputs.outputs):
            return


def test_startup_failure_is_reported() -> None:
    # Processes earlier tests left running (a Ray cluster lives for its module) are not this test's.
    before = {p.pid for p in psutil.Process().children()}

    async def scenario() -> None:
        # Too small a KV cache for even one max_model_len sequence: the core refuses to start.
        with pytest.raises(RuntimeError, match="failed to start"):
            await AsyncMPClient.start(_config(kv_cache_memory_bytes=1024))

    asyncio.run(scenario())
    # No engine process is left behind (multiprocessing's resource tracker lives as long as this process).
    leftovers = [
        p
        for p in psutil.Process().children()
        if p.pid not in before
        and p.status() != psutil.STATUS_ZOMBIE
        and "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert leftovers == []
