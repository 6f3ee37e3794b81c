"""Request: construction from the wire struct, token bookkeeping, statuses, priority order."""

from __future__ import annotations

import pytest

from pagedllm.core.request import Request, RequestStatus
from pagedllm.engine.protocol import EngineCoreRequest, FinishReason
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams


def test_from_engine_core_request_copies_every_field() -> None:
    sp = SamplingParams(max_tokens=5, stop_token_ids=[7, 9])
    wire = EngineCoreRequest("r1", [1, 2, 3], sp, 2, arrival_time=4.5, priority=3, lora_request=LoRARequest("a", 1, "/a")
    )
    seen: list[int] = []

    def hasher(req: Request) -> list[bytes]:
        seen.append(req.num_tokens)
        return []

    r = Request.from_engine_core_request(wire, hasher)
    assert (r.request_id, r.prompt_token_ids, r.eos_token_id) == ("r1", [1, 2, 3], 2)
    assert (r.arrival_time, r.priority, r.lora_int_id, r.max_tokens) == (4.5, 3, 1, 5)
    assert r.sampling_params is sp and r.stop_token_ids == frozenset({7, 9})
    assert r.status == RequestStatus.WAITING and r.get_finished_reason() is None
    assert (r.num_computed_tokens, r.num_cached_tokens, r.stop_reason) == (0, -1, None)
    # The prompt is copied: the caller's list is not the request's.
    wire.prompt_token_ids.append(99)
    assert r.prompt_token_ids == [1, 2, 3] and r.all_token_ids == [1, 2, 3]
    r.append_output_token_ids(4)
    r.append_output_token_ids([5, 6])
    assert r.output_token_ids == [4, 5, 6] and r.all_token_ids == [1, 2, 3, 4, 5, 6]
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (6, 3, 3)
    assert seen == [3, 4, 6]  # the hasher runs at construction and after every append


def test_unlimited_max_tokens_and_empty_prompt() -> None:
    assert Request("a", [1], SamplingParams(max_tokens=None), None).max_tokens is None
    with pytest.raises(ValueError, match="empty prompt"):
        Request("a", [], SamplingParams(), None)


@pytest.mark.parametrize(
    "status,finished,reason",
    [
        (RequestStatus.WAITING, False, None),
        (RequestStatus.RUNNING, False, None),
        (RequestStatus.PREEMPTED, False, None),
        (RequestStatus.FINISHED_STOPPED, True, FinishReason.STOP),
        (RequestStatus.FINISHED_LENGTH_CAPPED, True, FinishReason.LENGTH),
        (RequestStatus.FINISHED_ABORTED, True, FinishReason.ABORT),
        (RequestStatus.FINISHED_IGNORED, True, FinishReason.LENGTH),
    ],
)
def test_statuses(status: RequestStatus, finished: bool, reason: FinishReason | None) -> None:
    r = Request("a", [1], SamplingParams(), None)
    r.status = status
    assert r.is_finished() is finished and RequestStatus.is_finished(status) is finished
    assert r.get_finished_reason() == reason


def test_priority_order() -> None:
    def mk(req_id: str, priority: int, t: float) -> Request:
        return Request(req_id, [1], SamplingParams(), None, arrival_time=t, priority=priority)

    reqs = [mk("d", 1, 0.0), mk("b", 0, 2.0), mk("a", 0, 1.0), mk("c", 0, 2.0)]
    assert [r.request_id for r in sorted(reqs)] == ["a", "b", "c", "d"]
