"""What the scheduler tracks when several batches are in flight at once (pipeline parallelism).

With `pipeline_parallel_size` stages the engine keeps up to that many batches going, so that stage 1
runs batch N while stage 0 already runs batch N+1 (`EngineCore.step`). A request runs in at most one
batch at a time: its decode needs the token the batch before sampled. The scheduler gets this for
free (it advances `num_computed_tokens` when it schedules, so a decode in flight has nothing left to
schedule) except for the next chunk of a long prompt, which may run right behind the previous one.

What this class adds:
- the batches are balanced: each takes at most 1/depth of the live requests, so that decodes spread
  over all the batches in flight instead of one batch holding them all while the other stages idle;
- a request preempted while one of its batches is in flight is not resumed before that batch's
  output arrived (its tokens would be missing from the resumed copy).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from pagedllm.core.request import Request, RequestStatus


class BatchPipeline:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        # req_id -> batches in flight that run it (usually one; more while a prompt runs chunk after chunk).
        self._in_flight: Counter[str] = Counter()

    def seats(self, num_live_requests: int) -> int:
        """The most requests one batch may take: an even share of the live requests per batch."""
        return max(1, -(-num_live_requests // self.depth))

    def started(self, req_ids: Iterable[str]) -> None:
        in_flight = self._in_flight
        for req_id in req_ids:  # (Counter.update would add a mapping's values)
            in_flight[req_id] += 1

    def finished(self, req_ids: Iterable[str], requests: Mapping[str, Request]) -> list[str]:
        """A batch of `req_ids` came back: the requests whose outputs count. Not those preempted by a
        later batch: they recompute their tokens and sample again when resumed."""
        in_flight = self._in_flight
        current = []
        for req_id in req_ids:
            left = in_flight[req_id] - 1
            if left > 0:
                in_flight[req_id] = left
            else:
                del in_flight[req_id]
            request = requests.get(req_id)
            if request is None or request.status is not RequestStatus.PREEMPTED:
                current.append(req_id)
        return current

    def awaits_output(self, req_id: str) -> bool:
        return req_id in self._in_flight
