"""The engine core in its own process: handshake, requests over ZMQ, aborts, death detection, shutdown."""

from __future__ import annotations

import asyncio
import os
import signal

import psutil
import pytest

from pagedllm.config.args import EngineArgs
from pagedllm.engine.core_client import AsyncMPClient, EngineDeadError
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
                    assert "x" in outputs.errors
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


async def _first_output(client: AsyncMPClient, request_id: str) -> None:
    while True:
        outputs = await asyncio.wait_for(client.get_output_async(), 60)
        if any(o.request_id == request_id and o.new_token_ids for o in outputs.outputs):
            return


def test_startup_failure_is_reported() -> None:
    async def scenario() -> None:
        # Too small a KV cache for even one max_model_len sequence: the core refuses to start.
        with pytest.raises(RuntimeError, match="failed to start"):
            await AsyncMPClient.start(_config(kv_cache_memory_bytes=1024))

    asyncio.run(scenario())
    # No engine process is left behind (multiprocessing's resource tracker lives as long as this process).
    leftovers = [
        p
        for p in psutil.Process().children()
        if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert leftovers == []
