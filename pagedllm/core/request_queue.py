"""The scheduler's queue of waiting requests, ordered by the scheduling policy."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from pagedllm.core.request import Request


class RequestQueue:
    """Waiting requests. fcfs: a deque in arrival order (preempted requests re-enter at the front);
    priority: a heap on (priority, arrival_time)."""

    def __init__(self, policy: str) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy {policy!r} is not supported; use 'fcfs' or 'priority'")
        self.policy = policy
        self._deque: deque[Request] = deque()
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._deque.append(request)
        else:
            heapq.heappush(self._heap, request)

    def prepend(self, request: Request) -> None:
        """A preempted request: first in line under fcfs; under priority its rank decides anyway."""
        if self.policy == "fcfs":
            self._deque.appendleft(request)
        else:
            heapq.heappush(self._heap, request)

    def peek(self) -> Request:
        return self._deque[0] if self.policy == "fcfs" else self._heap[0]

    def pop(self) -> Request:
        return self._deque.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)

    def remove_many(self, requests: set[Request]) -> None:
        if self.policy == "fcfs":
            self._deque = deque(r for r in self._deque if r not in requests)
        else:
            self._heap = [r for r in self._heap if r not in requests]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._deque) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._deque) if self.policy == "fcfs" else iter(sorted(self._heap))
