"""EngineCore: the scheduler and the executor, stepped one batch at a time (or, under pipeline
parallelism, with one batch in flight per stage).

The front-end (LLMEngine in-process, or the server's engine-core process with its busy loop and ZMQ
I/O in `core_proc.py`) feeds it `EngineCoreRequest`s and calls `step()` while
`has_unfinished_requests()`. There is no process or socket code here, so the same object serves
offline use and the server.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from pagedllm.config.support import check_supported
from pagedllm.core.hashing import get_request_block_hasher
from pagedllm.core.request import Request, RequestStatus, validate_prompt_token_ids
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.distributed.kv_events import make_event_publisher
from pagedllm.distributed.kv_transfer import KVConnectorRole, create_connector
from pagedllm.engine.core_ops import EngineCoreOps
from pagedllm.engine.lora_ops import LoRAOps
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreRequest
from pagedllm.engine.utility import EngineSleepingError
from pagedllm.errors import ErrorReport
from pagedllm.executor import Executor
from pagedllm.executor.abstract import StepFuture
from pagedllm.kv_cache_interface import KVCacheSpec, check_num_blocks, num_blocks_from_budget
from pagedllm.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger("pagedllm.engine")


class EngineCore(EngineCoreOps, LoRAOps):
    def __init__(
        self, engine_config: EngineConfig, executor_class: type[Executor] | None = None, log_stats: bool = True
    ) -> None:
        self.engine_config = engine_config
        # Construction checked this already; a config edited since (or built with the gate lifted)
        # must not start an engine that silently ignores a feature.
        check_supported(engine_config)
        executor_class = executor_class or Executor.get_class(engine_config)
        self.model_executor = executor_class(engine_config)
        try:
            num_blocks = self._initialize_kv_caches()
            cache_config = engine_config.cache_config
            max_batches = self.model_executor.max_concurrent_batches
            self.structured_output_manager = _make_structured_output_manager(engine_config)
            self.scheduler = Scheduler(
                engine_config.scheduler_config,
                cache_config,
                num_blocks,
                engine_config.model_config.max_model_len,
                log_stats=log_stats,
                structured_output_manager=self.structured_output_manager,
                enable_kv_cache_events=_kv_events_enabled(engine_config),
                kv_connector=create_connector(engine_config, KVConnectorRole.SCHEDULER, self.kv_cache_spec),
                max_loras=engine_config.lora_config.max_loras if engine_config.lora_config else None,
                max_concurrent_batches=max_batches,
                num_lookahead_tokens=engine_config.num_lookahead_tokens,
            )
            self.block_hasher = get_request_block_hasher(cache_config)
            self.kv_event_publisher = make_event_publisher(
                engine_config.kv_events_config, engine_config.parallel_config.data_parallel_index
            )
        except BaseException:
            self.model_executor.shutdown()
            raise
        self._vocab_size: int = engine_config.model_config.get_vocab_size()
        self._pooling = engine_config.model_config.pooler_config is not None
        # The drafter stage runs only when a speculative method is configured.
        self._use_spec_decode = engine_config.speculative_config is not None
        # Requests refused at admission, reported (once) by the next step().
        self._admission_errors: dict[str, ErrorReport] = {}
        self._asleep: set[str] = set()
        # Pipeline parallelism: the batches in flight, oldest first (None: one batch at a time), and
        # the most that were ever in flight at once.
        self._max_batches = max_batches
        self._batch_queue: deque[tuple[SchedulerOutput, StepFuture]] | None = deque() if max_batches > 1 else None
        self.max_batches_in_flight = 0
        # Set whenever a grammar finishes compiling (see wait_for_grammars).
        self._grammar_ready = threading.Event()
        if self.structured_output_manager is not None:
            self.structured_output_manager.add_ready_listener(self._grammar_ready.set)

    def _initialize_kv_caches(self) -> int:
        """Size the KV cache in blocks, record it in `cache_config.num_gpu_blocks`, allocate it."""
        cfg = self.engine_config
        cache_config = cfg.cache_config
        rpc = self.model_executor.collective_rpc
        # Pipeline stages hold different layers: the block count fits the stage with the largest blocks.
        spec: KVCacheSpec = max(rpc("get_kv_cache_spec"), key=lambda s: s.bytes_per_block)
        self.kv_cache_spec = spec
        override = cache_config.num_gpu_blocks_override
        max_model_len = cfg.model_config.max_model_len
        if spec.num_layers == 0 and override is None:
            # No KV tensors (an encoder): blocks cost nothing, so every sequence may be at full length.
            override = cfg.scheduler_config.max_num_seqs * -(-max_model_len // spec.block_size)
        # With an explicit block count there is nothing to measure (and no profiling forward to run).
        budget = 0 if override is not None else min(rpc("determine_available_kv_cache_bytes"))
        num_blocks = num_blocks_from_budget(budget, spec.bytes_per_block, override)
        check_num_blocks(num_blocks, spec.block_size, max_model_len, spec.bytes_per_block)
        cache_config.num_gpu_blocks = num_blocks
        rpc("initialize_kv_cache", args=(num_blocks,))
        rpc("compile_or_warm_up_model")
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %.1fx max_model_len=%d)",
            num_blocks,
            spec.block_size,
            num_blocks * spec.block_size,
            num_blocks * spec.bytes_per_block / 2**20,
            num_blocks * spec.block_size / max_model_len,
            max_model_len,
        )
        return num_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. A request the scheduler refuses (e.g. longer than max_model_len) does not
        raise: the refusal is reported in the next `step()`'s `EngineCoreOutputs.errors`."""
        try:
            # A sleeping engine has no KV cache (and maybe no weights) to run it with.
            self.check_awake()
            # What would otherwise fail inside the forward (and take every other request down with
            # it); the front-end checks the same, this guards clients that talk to the core directly.
            validate_prompt_token_ids(request.prompt_token_ids, self._vocab_size)
            if (request.pooling_params is not None) != self._pooling:
                raise ValueError("pooling requests need a pooling model, and a pooling model serves no others")
            if request.lora_request is not None:
                self._require_lora()
            core_request = Request.from_engine_core_request(request, self.block_hasher)
            constraint = request.sampling_params.structured_outputs
            if constraint is not None:
                if self.structured_output_manager is None:
                    raise ValueError("structured outputs need a tokenizer (skip_tokenizer_init is set)")
                core_request.structured_output_request = self.structured_output_manager.grammar_init(
                    constraint, request.prompt_token_ids
                )
            self.scheduler.add_request(core_request)
        except Exception as e:  # the core must survive any bad request
            if not isinstance(e, ValueError | EngineSleepingError):
                logger.exception("request %s could not be added", request.request_id)
            self._admission_errors[request.request_id] = ErrorReport.of(e)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self._admission_errors) or self.scheduler.has_unfinished_requests() or bool(self._batch_queue)

    def waiting_for_grammars(self) -> bool:
        """Whether nothing can run until a grammar compiles: every unfinished request waits for its
        grammar (a step would schedule nothing)."""
        return (
            not self._admission_errors
            and not self._batch_queue
            and not self.scheduler.grammar_errors
            and self.scheduler.waiting_only_for_grammars()
        )

    def wait_for_grammars(self, timeout: float) -> None:
        """Sleep while `waiting_for_grammars()`, until a grammar compiles or ``timeout`` seconds pass (the
        in-process engine's wait; the server's core process waits on its input queue instead)."""
        self._grammar_ready.clear()
        if self.waiting_for_grammars():
            self._grammar_ready.wait(timeout)

    def step(self) -> EngineCoreOutputs:
        """Schedule one batch, run it, and return what each request produced.

        The stages, in order: schedule -> grammar bitmask (structured outputs) -> execute (the forward)
        -> sample (under the bitmask) -> propose drafts (speculative decoding) -> update the requests.
        The bitmask is computed while the workers run the forward, which it does not need."""
        if self.waiting_for_grammars():
            # Nothing to schedule: no empty forward, no stats message per call.
            outputs = EngineCoreOutputs()
        elif self._batch_queue is not None:
            outputs = self._step_with_batch_queue(self._batch_queue)
        elif self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            self.model_executor.execute_model(scheduler_output)
            grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
            runner_output = self.model_executor.sample_tokens(grammar_output)
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
            if self._use_spec_decode:
                draft_token_ids = self.model_executor.collective_rpc("propose_draft_token_ids")[0]
                if draft_token_ids is not None:
                    self.scheduler.update_draft_token_ids(draft_token_ids)
        else:
            outputs = EngineCoreOutputs()
        if self.scheduler.grammar_errors:
            self._admission_errors.update(self.scheduler.grammar_errors)
            self.scheduler.grammar_errors = {}
        if self._admission_errors:
            outputs.errors = self._admission_errors
            self._admission_errors = {}
        self.kv_event_publisher.publish_events(self.scheduler.take_kv_events())
        return outputs

    def _step_with_batch_queue(self, queue: deque[tuple[SchedulerOutput, StepFuture]]) -> EngineCoreOutputs:
        """Pipeline parallelism: while a stage is free, start another batch and return (nothing is
        finished yet); once every stage has one, or nothing more can be scheduled, wait for the oldest
        batch and return its outputs. Stage 0 then runs batch N+1 while stage 1 runs batch N."""
        if len(queue) < self._max_batches and self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.total_num_scheduled_tokens or scheduler_output.preempted_req_ids:
                grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
                queue.append((scheduler_output, self.model_executor.submit_step(scheduler_output, grammar_output)))
                self.max_batches_in_flight = max(self.max_batches_in_flight, len(queue))
                if len(queue) < self._max_batches:
                    return EngineCoreOutputs()
            else:
                # Every running request waits for its batch in flight: the runner learns of the
                # finished ones with the next batch.
                self.scheduler.finished_req_ids |= scheduler_output.finished_req_ids
        if not queue:
            return EngineCoreOutputs()
        scheduler_output, future = queue.popleft()
        return self.scheduler.update_from_output(scheduler_output, future.result())

    def reset_prefix_cache(self) -> bool:
        reset = bool(self.scheduler.reset_prefix_cache())
        self.kv_event_publisher.publish_events(self.scheduler.take_kv_events())
        return reset

    def call_utility(self, method: str, args: Any = (), kwargs: dict[str, Any] | None = None) -> Any:
        try:
            return super().call_utility(method, args, kwargs)
        finally:
            # Sleep and weight updates clear the prefix cache: subscribers learn it now, not with
            # the next request's step.
            self.kv_event_publisher.publish_events(self.scheduler.take_kv_events())

    def shutdown(self) -> None:
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()
        self.kv_event_publisher.shutdown()
        self.model_executor.shutdown()


def _kv_events_enabled(engine_config: EngineConfig) -> bool:
    kv_events_config = engine_config.kv_events_config
    return kv_events_config is not None and kv_events_config.enable_kv_cache_events


def _make_structured_output_manager(engine_config: EngineConfig) -> StructuredOutputManager | None:
    """The grammar manager; None without a tokenizer (a grammar works on the tokens' text). Cheap: the
    tokenizer and the vocabulary tables load with the first constrained request, off the step loop."""
    model_config = engine_config.model_config
    if model_config.skip_tokenizer_init:
        return None

    def load_tokenizer() -> Any:
        from pagedllm.tokenizer import get_tokenizer

        return get_tokenizer(model_config)

    return StructuredOutputManager(
        engine_config.structured_outputs_config,
        model_config.get_vocab_size(),
        list(model_config.eos_token_ids),
        load_tokenizer,
    )
