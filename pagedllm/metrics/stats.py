"""Per-iteration statistics computed in the front-end from the core's outputs.

The core reports what only it knows (queue lengths, KV usage, prefix cache counters) in
`SchedulerStats`; latencies are measured here, on the front-end's clock, when each output arrives —
that is the time a client can see a token, which is what TTFT and inter-token latency should measure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.engine.protocol import EngineCoreOutputs, FinishReason


@dataclass
class FinishedRequestStats:
    finish_reason: FinishReason
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    # Arrival to the first token the front-end saw: queueing plus prefill (the core reports no
    # scheduling time, so this is the closest measure of time spent waiting for the engine).
    queued_and_prefill_time: float


@dataclass
class IterationStats:
    """What one batch of core outputs contributed."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class _RequestTimes:
    arrival_time: float
    num_prompt_tokens: int
    num_generation_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float = 0.0


class RequestStatsTracker:
    """Tracks the requests in flight (by core request id) to turn outputs into latency samples."""

    def __init__(self) -> None:
        self._requests: dict[str, _RequestTimes] = {}

    def add_request(self, request_id: str, num_prompt_tokens: int, arrival_time: float | None = None) -> None:
        now = time.monotonic() if arrival_time is None else arrival_time
        self._requests[request_id] = _RequestTimes(arrival_time=now, num_prompt_tokens=num_prompt_tokens)

    def finish_request(
        self, request_id: str, reason: FinishReason, now: float | None = None
    ) -> FinishedRequestStats | None:
        """Finish a request the front-end ended (an abort, a stop string); None if it was not in flight."""
        times = self._requests.pop(request_id, None)
        if times is None:
            return None
        return _finished(times, reason, time.monotonic() if now is None else now)

    def update(self, outputs: EngineCoreOutputs, now: float | None = None) -> IterationStats:
        now = time.monotonic() if now is None else now
        stats = IterationStats()
        for output in outputs.outputs:
            times = self._requests.get(output.request_id)
            if times is None:
                continue
            num_new = len(output.new_token_ids)
            if num_new:
                if times.first_token_time is None:
                    times.first_token_time = now
                    stats.num_prompt_tokens += times.num_prompt_tokens
                    stats.time_to_first_tokens.append(now - times.arrival_time)
                else:
                    stats.inter_token_latencies.append(now - times.last_token_time)
                times.last_token_time = now
                times.num_generation_tokens += num_new
                stats.num_generation_tokens += num_new
            if output.finish_reason is not None:
                del self._requests[output.request_id]
                stats.finished_requests.append(_finished(times, output.finish_reason, now))
        for request_id in outputs.errors:
            self._requests.pop(request_id, None)
        return stats


def _finished(times: _RequestTimes, reason: FinishReason, now: float) -> FinishedRequestStats:
    first = times.first_token_time if times.first_token_time is not None else now
    return FinishedRequestStats(
        finish_reason=reason,
        e2e_latency=now - times.arrival_time,
        num_prompt_tokens=times.num_prompt_tokens,
        num_generation_tokens=times.num_generation_tokens,
        queued_and_prefill_time=first - times.arrival_time,
    )
