"""AsyncLLM's front-end logic over a scripted core client: streams, n > 1, aborts, stop strings, death."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from scripted_model import SCRIPT, fake_engine_config

from pagedllm.config import LoggingConfig, SchedulerConfig
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from pagedllm.errors import ErrorReport, RequestError
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.tokenizer import get_tokenizer


class ScriptedClient:
    """Stands in for AsyncMPClient: every live request gets the next SCRIPT token per step."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.requests: dict[str, EngineCoreRequest] = {}
        self.progress: dict[str, int] = {}
        self.aborted: list[str] = []
        self.reject: dict[str, ErrorReport] = {}
        self.pending_errors: dict[str, ErrorReport] = {}
        self.dead_error: EngineDeadError | None = None
        self.alive = True
        self.processes = [SimpleNamespace(is_alive=lambda: self.alive)]
        self.closed = False
        self._wake = asyncio.Event()

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if request.request_id in self.reject:
            self.pending_errors[request.request_id] = self.reject[request.request_id]
        else:
            self.requests[request.request_id] = request
            self.progress[request.request_id] = 0
        self._wake.set()

    def engine_index_of(self, request_id: str) -> int:
        return 0

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.aborted += request_ids
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    async def get_output_async(self) -> EngineCoreOutputs:
        while self.dead_error is None and not (self.requests or self.pending_errors):
            self._wake.clear()
            await self._wake.wait()
        if self.dead_error is not None:
            raise self.dead_error
        # One step per turn of the event loop, so consumers can act between steps.
        await asyncio.sleep(0)
        outputs = []
        for request_id, request in list(self.requests.items()):
            done = self.progress[request_id]
            self.progress[request_id] = done + 1
            finished = done + 1 >= request.sampling_params.max_tokens
            reason = FinishReason.LENGTH if finished else None
            outputs.append(
                EngineCoreOutput(request_id, [self.script[done % len(self.script)]], finish_reason=reason)
            )
            if finished:
                del self.requests[request_id]
        errors, self.pending_errors = self.pending_errors, {}
        stats = SchedulerStats(
            num_running_reqs=len(self.requests), kv_cache_usage=0.1 if self.requests else 0.0
        )
        return EngineCoreOutputs(outputs, scheduler_stats=stats, errors=errors)

    def kill(self) -> None:
        self.dead_error = EngineDeadError("The engine core process died unexpectedly (killed by signal 9)")
        self.alive = False
        self._wake.set()

    def shutdown(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Any:
    return get_tokenizer(smollm2_gguf)


Scenario = Callable[[AsyncLLM, ScriptedClient], Awaitable[None]]


def run(tokenizer: Any, scenario: Scenario, config: Any = None, log_requests: bool = False) -> None:
    async def main() -> None:
        client = ScriptedClient(tokenizer.encode(SCRIPT))
        engine = AsyncLLM(
            config or fake_engine_config(), client, tokenizer, "m", log_stats=False, log_requests=log_requests
        )
        try:
            await asyncio.wait_for(scenario(engine, client), 30)
        finally:
            await engine.shutdown()
        assert client.closed

    asyncio.run(main())


def _sample(engine: AsyncLLM, name: str) -> float:
    for line in engine.prometheus.render().decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.001)


def test_streamed_and_final_outputs(tokenizer: Any) -> None:
    async def scenario(engine: AsyncLLM, client: ScriptedClient) -> None:
        delta = SamplingParams(max_tokens=5, output_kind=RequestOutputKind.DELTA)
        final = SamplingParams(max_tokens=5, output_kind=RequestOutputKind.FINAL_ONLY)

        async def collect(request_id: str, params: SamplingParams) -> list[RequestOutput]:
            return [out async for out in engine.generate("Count:", params, request_id)]

        streamed, whole = await asyncio.gather(collect("s", delta), collect("f", final))
        expected = tokenizer.decode(tokenizer.encode(SCRIPT)[:5])
        assert len(streamed) > 1 and streamed[-1].finished and not streamed[0].finished
        assert "".join(o.outputs[0].text for o in streamed) == expected
        [only] = whole
        assert (
            only.finished and only.outputs[0].text == expected and only.outputs[0].finish_reason == "length"
        )
        assert _sample(engine, "pagedllm:generation_tokens_total") == 10
        assert _sample(engine, "pagedllm:request_success_total") == 2
        assert engine._collectors == {}

    run(tokenizer, scenario)


def test_n_fans_out_into_seeded_children(tokenizer: Any) -> None:
    async def scenario(engine: AsyncLLM, client: ScriptedClient) -> None:
        params = SamplingParams(n=2, seed=7, max_tokens=3, temperature=0.8)
        stream = await engine.add_request("p", "Count:", params)
        assert {rid: r.sampling_params.seed for rid, r in client.requests.items()} == {"0_p": 7, "1_p": 8}
        outputs = [out async for out in stream]
        assert outputs[-1].request_id == "p" and [c.index for c in outputs[-1].outputs] == [0, 1]

    run(tokenizer, scenario)


def test_leaving_a_stream_aborts_it_in_the_core(tokenizer: Any) -> None:
    async def scenario(engine: AsyncLLM, client: ScriptedClient) -> None:
        params = SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA)
        async for _ in engine.generate("Count:", params, "a"):
            break  # a client disconnect closes the generator the same way
        await _until(lambda: client.aborted == ["a"])
        assert not engine.output_processor.has_unfinished_requests()
        assert engine._collectors == {}
        assert 'finished_reason="abort"' in engine.prometheus.render().decode()

    run(tokenizer, scenario)


def test_stop_string_aborts_the_core_request(tokenizer: Any) -> None:
    async def scenario(engine: AsyncLLM, client: ScriptedClient) -> None:
        params = SamplingParams(max_tokens=10, stop=" four", output_kind=RequestOutputKind.FINAL_ONLY)
        [final] = [out async for out in engine.generate("Count:", params, "a")]
        assert final.outputs[0].text == " one two three" and final.outputs[0].stop_reason == " four"
        await _until(lambda: client.aborted == ["a"])

    run(tokenizer, scenario)


def test_invalid_and_refused_requests(tokenizer: Any) -> None:
    async def scenario(engine: AsyncLLM, client: ScriptedClient) -> None:
        with pytest.raises(ValueError, match="200 tokens.*128"):
            await engine.add_request("long", {"prompt_token_ids": [5] * 200}, SamplingParams(max_tokens=1))
        stream = await engine.add_request("a", "Count:", SamplingParams(max_tokens=50))
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("a", "Count:", SamplingParams(max_tokens=1))
        stream.abort()
        # A refusal by the core (the next step's `errors`) ends that request's stream alone.
        client.reject["r"] = ErrorReport("the core says no", "max_tokens")
        with pytest.raises(RequestError, match="the core says no") as info:
            async for _ in engine.generate("Count:", SamplingParams(max_tokens=2), "r"):
                pass
        assert info.value.param == "max_tokens"

    run(tokenizer, scenario)


def test_engine_death_fails_every_stream(tokenizer: Any) -> None:
    async def scenario(engine: AsyncLLM, client: ScriptedClient) -> None:
        await engine.check_health()
        stream = await engine.add_request(
            "a", "Count:", SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA)
        )
        iterator = aiter(stream)
        await anext(iterator)
        client.kill()
        with pytest.raises(EngineDeadError, match="signal 9"):
            async for _ in iterator:
                pass
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", "Count:", SamplingParams(max_tokens=1))

    run(tokenizer, scenario)


def test_shutdown_ends_streams_in_flight(tokenizer: Any) -> None:
    async def scenario(engine: AsyncLLM, client: ScriptedClient) -> None:
        stream = await engine.add_request(
            "a", "Count:", SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA)
        )
        iterator = aiter(stream)
        await anext(iterator)
        await engine.shutdown()
        with pytest.raises(EngineDeadError, match="shutting down"):
            await anext(iterator)
        assert client.aborted == ["a"]

    run(tokenizer, scenario)


def test_stream_interval_fewer_outputs_same_text(tokenizer: Any) -> None:
    texts: dict[int, str] = {}
    counts: dict[int, int] = {}
    for interval in (1, 4):

        async def scenario(engine: AsyncLLM, client: ScriptedClient, interval: int = interval) -> None:
            params = SamplingParams(max_tokens=10, output_kind=RequestOutputKind.DELTA)
            stream = await engine.add_request("s", "Count:", params)
            # Count what the front-end sends (a slow reader would see merged outputs).
            sent: list[RequestOutput] = []
            put = stream.collector.put
            stream.collector.put = lambda output: (sent.append(output), put(output))  # type: ignore[method-assign]
            received = [output async for output in stream]
            counts[interval] = len(sent)
            texts[interval] = "".join(o.outputs[0].text for o in received)

        run(tokenizer, scenario, fake_engine_config(scheduler_config=SchedulerConfig(stream_interval=interval)))
    assert texts[1] == texts[4] == tokenizer.decode(tokenizer.encode(SCRIPT)[:10])
    assert counts == {1: 10, 4: 4}  # tokens 1, 2-5, 6-9, 10


def test_request_log_of_the_server_front_end(tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The server's --enable-log-requests (AsyncLLM(log_requests=True)) logs what the offline engine does;
    without it nothing is logged even when the config enables it (--disable-log-requests wins)."""

    async def scenario(engine: AsyncLLM, client: ScriptedClient) -> None:
        async for _ in engine.generate("Count to ten:", SamplingParams(max_tokens=3), "r"):
            pass

    config = fake_engine_config(logging_config=LoggingConfig(enable_log_requests=True, max_log_len=2))
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.request_logger"):
        run(tokenizer, scenario, config, log_requests=True)
        lines = [r.getMessage() for r in caplog.records]
        assert lines[0].startswith("Received request r: prompt: 'Co', params: SamplingParams(")
        assert lines[0].endswith(f"prompt_token_ids: {tokenizer.encode('Count to ten:')[:2]}.")
        output_ids = tokenizer.encode(SCRIPT)[:3]
        assert lines[1] == (
            f"Generated response r: output: {tokenizer.decode(output_ids)[:2]!r}, "
            f"output_token_ids: {output_ids[:2]}, finish_reason: length"
        )
        caplog.clear()
        run(tokenizer, scenario, config, log_requests=False)
        assert caplog.records == []
