"""The waiting queue: arrival order with preempted requests in front (fcfs), or (priority, arrival)."""

from __future__ import annotations

import pytest

from pagedllm.core.request import Request
from pagedllm.core.request_queue import RequestQueue
from pagedllm.sampling_params import SamplingParams


def _req(req_id: str, priority: int = 0, t: float = 0.0) -> Request:
    return Request(req_id, [1], SamplingParams(), None, arrival_time=t, priority=priority)


def test_fcfs_keeps_arrival_order_and_puts_preempted_first() -> None:
    q = RequestQueue("fcfs")
    a, b, c = _req("a"), _req("b"), _req("c")
    q.add(a)
    q.add(b)
    q.prepend(c)
    assert [r.request_id for r in q] == ["c", "a", "b"]
    q.remove_many({a})
    assert q.pop() is c and q.peek() is b and len(q) == 1


def test_priority_orders_by_priority_then_arrival() -> None:
    q = RequestQueue("priority")
    for r in (_req("late", 0, 2.0), _req("low", 5, 0.0), _req("early", 0, 1.0)):
        q.add(r)
    q.prepend(_req("preempted", 1, 0.5))
    assert [r.request_id for r in q] == ["early", "late", "preempted", "low"]
    assert q.pop().request_id == "early"


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="'lifo'"):
        RequestQueue("lifo")
