"""The scheduler's output stage: a step's sampled tokens become request progress (accepted drafts,
stops, grammar advance, freed requests) and the engine outputs and statistics the front-end receives.

Composed into `Scheduler` (pagedllm/core/scheduler.py): the scheduler hands it the requests it shares
and the callback that frees one; kept apart because it is the one concept of the scheduler that runs
after the model, not before it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pagedllm.core.outputs import EngineCoreOutput, SchedulerStats
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.runner_output import ModelRunnerOutput, trim_logprobs
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.core.spec_stats import SpecDecodingStats

if TYPE_CHECKING:
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.pipelining import BatchPipeline

logger = logging.getLogger("pagedllm.core")


@dataclass
class SchedulerCounters:
    """What the scheduler counts between two `make_stats` calls."""

    num_preemptions: int = 0
    # Prompt tokens looked up in / supplied by the KV connector.
    external_queries: int = 0
    external_hits: int = 0
    kv_connector_stats: dict[str, float] = field(default_factory=dict)
    spec: SpecDecodingStats = field(default_factory=SpecDecodingStats)

    def take(self) -> SchedulerCounters:
        """The counts so far; the counters start again from zero."""
        taken = replace(self)
        self.num_preemptions = self.external_queries = self.external_hits = 0
        self.kv_connector_stats, self.spec = {}, SpecDecodingStats()
        return taken


class SchedulerUpdate:
    """`apply`: a step's runner output becomes request progress and engine outputs."""

    def __init__(
        self,
        requests: dict[str, Request],
        max_model_len: int,
        pipeline: BatchPipeline | None,
        counters: SchedulerCounters,
        free_request: Callable[[Request], None],
    ) -> None:
        # The scheduler's live requests (shared: the scheduler adds them, `free_request` removes them).
        self.requests = requests
        self.max_model_len = max_model_len
        self.pipeline = pipeline
        self.counters = counters
        self._free_request = free_request

    def _check_stop(self, request: Request) -> bool:
        """After a token was appended: set the finished status and return True if the request ends."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            last = request.output_token_ids[-1]
            if last == request.eos_token_id and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in request.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return True
        # max_model_len wins over min_tokens: the sequence cannot grow past it.
        max_tokens = request.max_tokens
        if request.num_tokens >= self.max_model_len or (
            max_tokens is not None and request.num_output_tokens >= max_tokens
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def apply(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> tuple[list[EngineCoreOutput], bool]:
        """The step's engine outputs, and whether some request stopped (and was freed)."""
        outputs: list[EngineCoreOutput] = []
        index = model_runner_output.req_id_to_index
        sampled = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        pooler_output = model_runner_output.pooler_output
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        any_stopped = False
        for key, value in model_runner_output.kv_connector_stats.items():
            stats = self.counters.kv_connector_stats
            stats[key] = stats.get(key, 0.0) + value
        req_ids: Iterable[str] = scheduler_output.num_scheduled_tokens
        if self.pipeline is not None:
            req_ids = self.pipeline.finished(req_ids, self.requests)
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue  # aborted after it was scheduled
            i = index.get(req_id)
            generated = sampled[i] if i is not None else []
            if spec_decode_tokens and generated and req_id in spec_decode_tokens:
                # The runner returns the accepted drafts plus one token: the KV of the rejected
                # drafts is recomputed (overwritten) from here on.
                request.num_computed_tokens -= len(spec_decode_tokens[req_id]) + 1 - len(generated)
                self.counters.spec.observe(len(spec_decode_tokens[req_id]), len(generated) - 1)
            new_token_ids: list[int] = []
            stopped = False
            grammar = request.structured_output_request
            for token_id in generated:
                request.append_output_token_ids(token_id)
                new_token_ids.append(token_id)
                if grammar is not None and not grammar.accept_token(token_id):
                    logger.error("request %s: token %d is not allowed by its grammar", req_id, token_id)
                if self._check_stop(request):
                    stopped = True
                    break
                if grammar is not None and grammar.is_terminated():
                    # The grammar is complete (it accepted its stop token): nothing else may follow.
                    request.status = RequestStatus.FINISHED_STOPPED
                    stopped = True
                    break
            pooled = pooler_output.get(req_id)
            if pooled is not None:
                # A pooling request is done once its prompt is computed: it generates nothing.
                request.status = RequestStatus.FINISHED_STOPPED
                stopped = True
            req_prompt_logprobs = prompt_logprobs.get(req_id)
            if not (new_token_ids or req_prompt_logprobs is not None or stopped):
                continue  # mid-prefill chunk: nothing to report
            # A request with new tokens was in the runner's output, so `i` is set.
            new_logprobs = logprobs[i] if new_token_ids and i is not None and i < len(logprobs) else None
            if new_logprobs is not None and len(new_logprobs.sampled_token_ranks) > len(new_token_ids):
                # Stopped inside a run of accepted drafts: the tokens after the stop are dropped.
                new_logprobs = trim_logprobs(new_logprobs, len(new_token_ids))
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=new_logprobs,
                    new_prompt_logprobs=req_prompt_logprobs,
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    num_external_computed_tokens=request.num_external_computed_tokens,
                    # Rides on the first output rather than a message of its own (a mid-prefill chunk
                    # reports nothing): queue time is only recorded once the request finishes anyway.
                    first_scheduled_time=request.take_first_scheduled_time(),
                    pooling_output=pooled,
                )
            )
            if stopped:
                any_stopped = True
                self._free_request(request)
        return outputs, any_stopped


def make_scheduler_stats(
    counters: SchedulerCounters,
    kv_cache_manager: KVCacheManager,
    running: list[Request],
    waiting: list[Request],
    count_adapters: bool,
) -> SchedulerStats:
    """Queue lengths and cache usage now; prefix-cache counts and the counters since the last call
    (`waiting` includes the requests whose grammar still compiles, as vLLM's num_requests_waiting)."""
    queries, hits = kv_cache_manager.take_prefix_cache_stats()
    counts = counters.take()
    spec = counts.spec
    return SchedulerStats(
        num_running_reqs=len(running),
        num_waiting_reqs=len(waiting),
        kv_cache_usage=kv_cache_manager.usage,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        num_preemptions=counts.num_preemptions,
        external_prefix_cache_queries=counts.external_queries,
        external_prefix_cache_hits=counts.external_hits,
        kv_connector_stats=counts.kv_connector_stats,
        running_lora_adapters=_adapter_counts(running) if count_adapters else {},
        waiting_lora_adapters=_adapter_counts(waiting) if count_adapters else {},
        spec_num_drafts=spec.num_drafts,
        spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_num_accepted_tokens_per_pos=spec.num_accepted_tokens_per_pos,
    )


def _adapter_counts(requests: Iterable[Request]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_request is not None:
            counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
    return counts
