"""Per-iteration statistics computed in the front-end from the core's outputs.

The core reports what only it knows (queue lengths, KV usage, prefix cache counters) in
`SchedulerStats`, and when it first scheduled each request (`EngineCoreOutput.first_scheduled_time`);
latencies are measured here, when each output arrives — that is the time a client can see a token, which
is what TTFT and inter-token latency should measure. Every time here is wall clock (time.time()): the
arrival time comes from the request and the scheduling time from the core's process, and only the wall
clock is shared between processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.core.outputs import EngineCoreOutput, EngineCoreOutputs, FinishReason


@dataclass
class FinishedRequestStats:
    finish_reason: FinishReason
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    # Arrival to the first time the core scheduled the request; None when the core never reported it
    # (the time rides on the request's first output: aborted or rejected before that).
    queue_time: float | None
    # First scheduled to first token (None unless both happened), first to last token (None without a
    # token), and first scheduled to last token: vLLM's prefill, decode and inference phases.
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    # The request's max_tokens (vllm:request_params_max_tokens) and its prompt tokens served from a cache.
    max_tokens_param: int | None = None
    num_cached_tokens: int = 0
    # Set on the last request of a user request to finish (each of its n choices is one): its n, and the
    # most tokens any of them generated (vllm:request_params_n, vllm:request_max_num_generation_tokens).
    params_n: int | None = None
    max_num_generation_tokens: int | None = None

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between this request's tokens (None with fewer than two)."""
        if self.decode_time is None or self.num_generation_tokens < 2:
            return None
        return self.decode_time / (self.num_generation_tokens - 1)


@dataclass
class IterationStats:
    """What one batch of core outputs contributed."""

    num_prompt_tokens: int = 0
    # The prompt tokens above by where their KV came from (vllm:prompt_tokens_by_source): computed here,
    # found in the local prefix cache, loaded by a KV connector; and the cached ones computed again
    # anyway (a fully cached prompt's last token, which must run to sample from).
    num_prompt_tokens_computed: int = 0
    num_prompt_tokens_local_hit: int = 0
    num_prompt_tokens_external: int = 0
    num_prompt_tokens_recomputed: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class _ParentStats:
    """A user request made of n core requests (its choices)."""

    n: int
    num_finished: int = 0
    max_num_generation_tokens: int = 0


@dataclass
class _RequestTimes:
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int | None = None
    parent: _ParentStats | None = None
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float = 0.0


class RequestStatsTracker:
    """Tracks the requests in flight (by core request id) to turn outputs into latency samples."""

    def __init__(self) -> None:
        self._requests: dict[str, _RequestTimes] = {}
        self._parents: dict[str, _ParentStats] = {}
        self._parent_ids: dict[str, str | None] = {}

    def add_request(
        self,
        request_id: str,
        num_prompt_tokens: int,
        arrival_time: float | None = None,
        max_tokens: int | None = None,
        parent: tuple[str, int] | None = None,
    ) -> None:
        """``parent``: the user request's id and n, for a core request that is one of its n choices."""
        now = time.time() if arrival_time is None else arrival_time
        parent_stats = None
        if parent is not None:
            parent_stats = self._parents.setdefault(parent[0], _ParentStats(parent[1]))
        self._requests[request_id] = _RequestTimes(
            arrival_time=now, num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens, parent=parent_stats
        )
        self._parent_ids[request_id] = parent[0] if parent is not None else None

    def finish_request(
        self, request_id: str, reason: FinishReason, now: float | None = None
    ) -> FinishedRequestStats | None:
        """Finish a request the front-end ended (an abort, a stop string); None if it was not in flight."""
        times = self._requests.pop(request_id, None)
        if times is None:
            return None
        return self._finish(request_id, times, reason, time.time() if now is None else now)

    def _finish(
        self, request_id: str, times: _RequestTimes, reason: FinishReason, now: float
    ) -> FinishedRequestStats:
        finished = _finished(times, reason, now)
        parent = times.parent
        parent_id = self._parent_ids.pop(request_id, None)
        if parent is None:
            finished.params_n, finished.max_num_generation_tokens = 1, times.num_generation_tokens
            return finished
        parent.num_finished += 1
        parent.max_num_generation_tokens = max(parent.max_num_generation_tokens, times.num_generation_tokens)
        if parent.num_finished == parent.n:
            finished.params_n, finished.max_num_generation_tokens = parent.n, parent.max_num_generation_tokens
            if parent_id is not None:
                self._parents.pop(parent_id, None)
        return finished

    def update(self, outputs: EngineCoreOutputs, now: float | None = None) -> IterationStats:
        now = time.time() if now is None else now
        stats = IterationStats()
        for output in outputs.outputs:
            times = self._requests.get(output.request_id)
            if times is None:
                continue
            if output.first_scheduled_time is not None and times.first_scheduled_time is None:
                times.first_scheduled_time = output.first_scheduled_time
            num_new = len(output.new_token_ids)
            if num_new:
                if times.first_token_time is None:
                    times.first_token_time = now
                    times.num_cached_tokens = output.num_cached_tokens
                    _count_prompt_sources(stats, times.num_prompt_tokens, output)
                    stats.time_to_first_tokens.append(now - times.arrival_time)
                else:
                    stats.inter_token_latencies.append(now - times.last_token_time)
                times.last_token_time = now
                times.num_generation_tokens += num_new
                stats.num_generation_tokens += num_new
            if output.finish_reason is not None:
                del self._requests[output.request_id]
                stats.finished_requests.append(
                    self._finish(output.request_id, times, output.finish_reason, now)
                )
        for request_id in outputs.errors:
            if self._requests.pop(request_id, None) is not None:
                parent_id = self._parent_ids.pop(request_id, None)
                # A refused choice fails its whole user request: nothing is left to wait for.
                if parent_id is not None:
                    self._parents.pop(parent_id, None)
        return stats


def _count_prompt_sources(stats: IterationStats, num_prompt_tokens: int, output: EngineCoreOutput) -> None:
    """vLLM's split of the prompt's tokens by source; a fully cached prompt's last token is computed
    again (it must run to sample from) and counts as both cached and recomputed."""
    cached = output.num_cached_tokens
    recomputed = 1 if cached + 1 == num_prompt_tokens else 0
    stats.num_prompt_tokens += num_prompt_tokens
    stats.num_prompt_tokens_computed += num_prompt_tokens - cached
    stats.num_prompt_tokens_local_hit += cached + recomputed - output.num_external_computed_tokens
    stats.num_prompt_tokens_external += output.num_external_computed_tokens
    stats.num_prompt_tokens_recomputed += recomputed


def _finished(times: _RequestTimes, reason: FinishReason, now: float) -> FinishedRequestStats:
    scheduled = times.first_scheduled_time
    first_token = times.first_token_time
    # Two processes' readings of the wall clock: a step of the clock in between must not make a negative
    # duration.
    queue_time = None if scheduled is None else max(scheduled - times.arrival_time, 0.0)
    prefill_time = None if scheduled is None or first_token is None else max(first_token - scheduled, 0.0)
    decode_time = None if first_token is None else times.last_token_time - first_token
    inference_time = None
    if scheduled is not None and first_token is not None:
        inference_time = max(times.last_token_time - scheduled, 0.0)
    return FinishedRequestStats(
        finish_reason=reason,
        e2e_latency=now - times.arrival_time,
        num_prompt_tokens=times.num_prompt_tokens,
        num_generation_tokens=times.num_generation_tokens,
        queue_time=queue_time,
        prefill_time=prefill_time,
        decode_time=decode_time,
        inference_time=inference_time,
        max_tokens_param=times.max_tokens,
        num_cached_tokens=times.num_cached_tokens,
    )
