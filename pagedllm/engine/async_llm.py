"""`AsyncLLM`: the asyncio front-end of the server over an EngineCore in its own process.

The event loop only validates and tokenizes requests, detokenizes outputs and moves messages: the model
runs in the core process (`AsyncMPClient`; with data parallelism one core per rank, `DPAsyncMPClient`).
One output-handler task reads the core's outputs, turns them
into `RequestOutput`s (`OutputProcessor`) and drops each into its request's one-slot mailbox
(`RequestOutputCollector`), which the request's `RequestStream` reads. Leaving a stream early (client
disconnect, cancelled task) aborts the request in the core, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pagedllm.config.watermark_check import check_supports_watermarking
from pagedllm.engine.core_client import AsyncMPClient, EngineCoreProcess, EngineDeadError
from pagedllm.engine.dp_client import DPAsyncMPClient, start_core_client
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor, RequestOutputCollector
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreRequest, FinishReason
from pagedllm.engine.request_observer import RequestObserver
from pagedllm.engine.utility import EngineSleepingError
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.loggers import LoggingStatLogger
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.stats import IterationStats, RequestStatsTracker
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.checker import ConstraintChecker

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger("pagedllm.engine.async_llm")


class RequestStream:
    """The outputs of one request, as an async iterator that ends after the final output.

    Stopping early (break, cancellation, an exception in the consumer) aborts the request."""

    def __init__(self, engine: AsyncLLM, request_id: str, collector: RequestOutputCollector) -> None:
        self.engine = engine
        self.request_id = request_id
        self.collector = collector
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                output = await self.collector.get()
                self.finished = output.finished
                yield output
        finally:
            if not self.finished:
                self.abort()
            self.engine._collectors.pop(self.request_id, None)

    def abort(self) -> None:
        """Abort the request in the engine (no-op once it finished)."""
        if not self.finished:
            self.finished = True
            self.engine.abort_now(self.request_id)


class AsyncLLM:
    def __init__(
        self,
        engine_config: EngineConfig,
        client: AsyncMPClient | DPAsyncMPClient,
        tokenizer: Any,
        model_name: str,
        log_stats: bool = True,
        log_requests: bool = False,
    ) -> None:
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.tokenizer = tokenizer
        self.client = client
        self.input_processor = InputProcessor(
            self.model_config,
            tokenizer,
            engine_config.structured_outputs_config,
            functools.partial(check_supports_watermarking, engine_config),
            engine_config.scheduler_config.policy,
        )
        # Constraints (JSON schemas, regexes, grammars) are checked in a child process, off the event loop.
        self.constraint_checker = ConstraintChecker(engine_config.structured_outputs_config)
        self.observer = RequestObserver.from_config(engine_config, model_name, log_requests)
        self.output_processor = OutputProcessor(
            tokenizer, engine_config.scheduler_config.stream_interval, self.observer
        )
        self.max_model_len: int = int(self.model_config.max_model_len)
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._tracker = RequestStatsTracker()
        lora_config = engine_config.lora_config
        self.prometheus = PrometheusStatLogger(
            model_name,
            self.max_model_len,
            lora_config.max_loras if lora_config is not None else None,
            speculative=engine_config.speculative_config is not None,
            engine_indexes=_metric_engine_indexes(engine_config),
        )
        self.prometheus.record_sleep_state(0)
        startup = getattr(client, "startup_info", None)
        cache = engine_config.cache_config
        cache_config = {field.name: getattr(cache, field.name) for field in dataclasses.fields(cache)}
        if startup is not None:
            # Sized in the core's process: known here from what it reported at start-up.
            cache_config["num_gpu_blocks"] = startup.num_gpu_blocks
        self.prometheus.log_cache_config(cache_config)
        # LoRA adapters the core has read and checked (each is checked before its first request).
        self._loras: set[int] = set()
        self.stat_logger = LoggingStatLogger() if log_stats else None
        self._background: set[asyncio.Task[Any]] = set()
        self._handler_error: EngineDeadError | None = None
        # Set by sleep(), cleared once wake_up() restored everything: new requests get a 503 meanwhile.
        self._sleeping = False
        loop = asyncio.get_running_loop()
        self._output_task = loop.create_task(self._output_handler())
        self._stats_task: asyncio.Task[None] | None = None
        if self.stat_logger is not None:
            self._stats_task = loop.create_task(
                self._log_stats_loop(engine_config.logging_config.log_stats_interval)
            )

    @classmethod
    async def create(
        cls,
        engine_config: EngineConfig,
        model_name: str,
        log_stats: bool = True,
        core_process: EngineCoreProcess | None = None,
        log_requests: bool = False,
    ) -> AsyncLLM:
        """Start the engine core (in `core_process` if one was started early) and the front-end around it;
        ``log_requests`` writes the request log (the server's --enable-log-requests)."""
        from pagedllm.tokenizer import get_tokenizer

        # The core loads the model while this process loads the tokenizer (in a thread: it reads files,
        # and the event loop stays free).
        client_start = asyncio.create_task(start_core_client(engine_config, core_process))
        try:
            tokenizer = await asyncio.to_thread(get_tokenizer, engine_config.model_config)
        except BaseException:
            client_start.cancel()
            with contextlib.suppress(BaseException):
                (await client_start).shutdown()
            raise
        client = await client_start
        return cls(engine_config, client, tokenizer, model_name, log_stats, log_requests)

    # ------------------------------------------------------------------------------------ requests
    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None,
        priority: int = 0,
        trace_headers: dict[str, str] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate and send a request (ValueError naming the problem if it is invalid); ``trace_headers``
        (W3C traceparent/tracestate) make its trace span a child of the caller's."""
        self._raise_if_dead()
        if self._sleeping:
            raise EngineSleepingError()
        if request_id in self._collectors:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is not None and lora_request.lora_int_id not in self._loras:
            await self.add_lora(lora_request)
        if isinstance(params, SamplingParams):
            params = await self._check_constraint(params)
        request, prompt_text = self.input_processor.process_inputs(
            request_id,
            prompt,
            params,
            priority=priority,
            trace_headers=trace_headers,
            lora_request=lora_request,
        )
        collector = RequestOutputCollector(request.sampling_params.output_kind)
        core_requests = self.output_processor.add_user_request(request, prompt_text, sink=collector)
        self._collectors[request_id] = collector
        # The n choices of a request are core requests of their own; the metrics see them as one.
        parent = (request_id, len(core_requests)) if len(core_requests) > 1 else None
        try:
            for core_request in core_requests:
                await self._send(core_request, parent)
        except BaseException:
            self.abort_now(request_id)
            self._collectors.pop(request_id, None)
            raise
        return RequestStream(self, request_id, collector)

    async def _check_constraint(self, params: SamplingParams) -> SamplingParams:
        """``params``, or a copy whose constraint is checked and its backend resolved (off the event
        loop; the input processor then only checks the cheap rest)."""
        constraint = params.structured_outputs
        if constraint is None or constraint.resolved_backend is not None:
            return params
        self.input_processor.check_structured_outputs_enabled()
        params = params.clone()  # never mutate the caller's
        await self.constraint_checker.check(params.structured_outputs)  # type: ignore[arg-type]
        return params

    async def _send(self, request: EngineCoreRequest, parent: tuple[str, int] | None = None) -> None:
        # The request's own (wall-clock) arrival, the same clock as the core's scheduling time.
        self._tracker.add_request(
            request.request_id,
            len(request.prompt_token_ids),
            arrival_time=request.arrival_time,
            max_tokens=request.sampling_params.max_tokens,
            parent=parent,
        )
        await self.client.add_request_async(request)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        request_id: str,
        priority: int = 0,
        trace_headers: dict[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they are produced (the final one has ``finished=True``)."""
        stream = await self.add_request(request_id, prompt, sampling_params, priority, trace_headers)
        async for output in stream:
            yield output

    def abort_now(self, request_id: str) -> None:
        """Forget a request here and abort it in the core (the message is sent in the background)."""
        core_ids = self.output_processor.abort_requests([request_id])
        self._collectors.pop(request_id, None)
        for core_id in core_ids:
            finished = self._tracker.finish_request(core_id, FinishReason.ABORT)
            if finished is not None:
                engine = self.client.engine_index_of(core_id)
                self.prometheus.record(None, IterationStats(finished_requests=[finished]), engine)
        if core_ids and not self.is_dead:
            self._spawn(self.client.abort_requests_async(core_ids))

    async def abort(self, request_id: str) -> None:
        self.abort_now(request_id)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---------------------------------------------------------------------------------- operations
    async def call_utility(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """An engine operation by name (`pagedllm.engine.utility.UTILITY_METHODS`), run in the core
        between two steps; ValueError for bad arguments."""
        self._raise_if_dead()
        return await self.client.call_utility_async(method, *args, **kwargs)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check a LoRA adapter in the core (ValueError naming the problem)."""
        added = bool(await self.call_utility("add_lora", lora_request))
        self._loras.add(lora_request.lora_int_id)
        return added

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (ValueError while an unfinished request uses it)."""
        removed = bool(await self.call_utility("remove_lora", lora_int_id))
        self._loras.discard(lora_int_id)
        return removed

    async def sleep(self, level: int = 1) -> None:
        await self.call_utility("sleep", level)
        self._sleeping = True
        self.prometheus.record_sleep_state(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.call_utility("wake_up", tags)
        self._sleeping = bool(await self.call_utility("is_sleeping"))
        if not self._sleeping:
            self.prometheus.record_sleep_state(0)

    def is_sleeping(self) -> bool:
        return self._sleeping

    # --------------------------------------------------------------------------------------- health
    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._handler_error or self.client.dead_error

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def _raise_if_dead(self) -> None:
        error = self.dead_error
        if error is not None:
            raise error

    async def check_health(self) -> None:
        """Raises EngineDeadError when the engine can no longer serve requests."""
        self._raise_if_dead()
        if not all(process.is_alive() for process in self.client.processes):
            raise EngineDeadError("An engine core process is not running")

    # --------------------------------------------------------------------------------- output loop
    async def _output_handler(self) -> None:
        try:
            while True:
                outputs = await self.client.get_output_async()
                self._process(outputs)
        except EngineDeadError as e:
            self._fail_all(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("The output handler failed")
            self._handler_error = EngineDeadError(
                f"The server's output handler failed: {type(e).__name__}: {e}"
            )
            self._fail_all(self._handler_error)

    def _process(self, outputs: EngineCoreOutputs) -> None:
        processed = self.output_processor.process_outputs(outputs)
        for request_id, report in processed.errors.items():
            collector = self._collectors.get(request_id)
            if collector is not None:
                collector.put(report.to_error())
        if processed.reqs_to_abort:
            # Stop strings finished these in the front-end; the core would keep generating.
            self._spawn(self.client.abort_requests_async(processed.reqs_to_abort))
        iteration_stats = self._tracker.update(outputs)
        for core_id in processed.reqs_to_abort:
            finished = self._tracker.finish_request(core_id, FinishReason.STOP)
            if finished is not None:
                iteration_stats.finished_requests.append(finished)
        self.prometheus.record(outputs.scheduler_stats, iteration_stats, outputs.engine_index)
        if self.stat_logger is not None:
            self.stat_logger.record(outputs.scheduler_stats, iteration_stats, outputs.engine_index)

    def _fail_all(self, error: Exception) -> None:
        for collector in self._collectors.values():
            collector.put(error)
        self._collectors.clear()

    async def _log_stats_loop(self, interval: float) -> None:
        assert self.stat_logger is not None
        while True:
            await asyncio.sleep(interval)
            self.stat_logger.log()

    # ------------------------------------------------------------------------------------ shutdown
    def fail_all_requests(self, reason: str) -> None:
        """End every request in flight with EngineDeadError(reason) and abort it in the core: its
        handler then answers the client with that error instead of being cut off."""
        for request_id, collector in list(self._collectors.items()):
            collector.put(EngineDeadError(reason))
            self.abort_now(request_id)

    async def shutdown(self) -> None:
        """Abort what is still running, stop the core process and the background tasks."""
        self.fail_all_requests("The server is shutting down")
        if self._background:
            await asyncio.wait(list(self._background), timeout=2)
        tasks = [t for t in (self._output_task, self._stats_task) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Synchronous on purpose: the sockets belong to this loop, and nothing else is served any more.
        self.client.shutdown()
        self.constraint_checker.close()
        if self.observer is not None:
            self.observer.shutdown()


def _metric_engine_indexes(engine_config: EngineConfig) -> list[int] | None:
    """The `engine` label values of the metrics: each data parallel rank this server runs (all of them,
    or its one rank behind an external load balancer); None without data parallelism (no label)."""
    pc = engine_config.parallel_config
    if pc.data_parallel_size == 1:
        return None
    if pc.data_parallel_external_lb:
        return [pc.data_parallel_index]
    return list(range(pc.data_parallel_size))
