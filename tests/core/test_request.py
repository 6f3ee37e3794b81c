"""Request: construction from the protocol message, token bookkeeping, statuses; core/ stays torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedllm.config import CacheConfig
from pagedllm.core.hashing import RequestBlockHasher, get_request_block_hasher
from pagedllm.core.request import Request, RequestStatus
from pagedllm.engine.protocol import EngineCoreRequest, FinishReason
from pagedllm.sampling_params import SamplingParams


def hasher(block_size: int = 4) -> RequestBlockHasher | None:
    return get_request_block_hasher(CacheConfig(block_size=block_size))


def test_from_engine_core_request() -> None:
    params = SamplingParams(max_tokens=7, stop_token_ids=[3, 5])
    core_req = EngineCoreRequest(
        "r1", list(range(10)), params, eos_token_id=2, arrival_time=1.5, priority=3, lora_int_id=0
    )
    r = Request.from_engine_core_request(core_req, hasher())
    assert (r.request_id, r.eos_token_id, r.arrival_time, r.priority) == ("r1", 2, 1.5, 3)
    assert r.prompt_token_ids == r.all_token_ids == list(range(10)) and r.num_tokens == 10
    assert r.output_token_ids == [] and r.num_computed_tokens == 0
    assert r.status == RequestStatus.WAITING and r.get_finished_reason() is None
    assert r.max_tokens == 7 and r.stop_token_ids == frozenset({3, 5})
    assert len(r.block_hashes) == 2  # two full blocks of 4; the last 2 tokens are not hashed yet
    # The request's token lists are its own: the message's list is not aliased.
    core_req.prompt_token_ids.append(99)
    assert r.num_tokens == 10


def test_output_tokens_extend_all_tokens_and_hash_filled_blocks() -> None:
    r = Request("a", [1, 2, 3], SamplingParams(), None, block_hasher=hasher())
    assert r.block_hashes == []
    r.append_output_token_ids(4)
    assert len(r.block_hashes) == 1
    r.append_output_token_ids([5, 6, 7, 8])
    assert r.output_token_ids == [4, 5, 6, 7, 8] and r.num_output_tokens == 5
    assert r.all_token_ids == [1, 2, 3, 4, 5, 6, 7, 8] and len(r.block_hashes) == 2
    # The same tokens as a prompt give the same hashes: output blocks are shareable prefixes.
    assert Request("b", list(range(1, 9)), SamplingParams(), None, block_hasher=hasher()).block_hashes == (
        r.block_hashes
    )


def test_no_hashes_without_hasher() -> None:
    r = Request("a", list(range(8)), SamplingParams(), None)
    r.append_output_token_ids(list(range(8)))
    assert r.block_hashes == []


def test_empty_prompt_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        Request("a", [], SamplingParams(), None)


@pytest.mark.parametrize(
    "status,reason",
    [
        (RequestStatus.WAITING, None),
        (RequestStatus.RUNNING, None),
        (RequestStatus.PREEMPTED, None),
        (RequestStatus.FINISHED_STOPPED, FinishReason.STOP),
        (RequestStatus.FINISHED_LENGTH_CAPPED, FinishReason.LENGTH),
        (RequestStatus.FINISHED_ABORTED, FinishReason.ABORT),
        (RequestStatus.FINISHED_IGNORED, FinishReason.LENGTH),
    ],
)
def test_finished_reasons(status: RequestStatus, reason: FinishReason | None) -> None:
    r = Request("a", [1], SamplingParams(), None)
    r.status = status
    assert r.get_finished_reason() == reason
    assert r.is_finished() == (reason is not None)


def test_priority_order() -> None:
    def make(req_id: str, priority: int, t: float) -> Request:
        return Request(req_id, [1], SamplingParams(), None, arrival_time=t, priority=priority)

    reqs = [make("c", 1, 0.0), make("b", 0, 2.0), make("a", 0, 1.0), make("d", 0, 1.0)]
    assert [r.request_id for r in sorted(reqs)] == ["a", "d", "b", "c"]


def test_core_imports_no_torch() -> None:
    """House rule: the scheduler side runs (and is tested) without torch."""
    code = (
        "import sys\n"
        "import pagedllm.core.scheduler, pagedllm.core.kv_cache_manager, pagedllm.core.hashing\n"
        "import pagedllm.core.sched_output, pagedllm.core.runner_output\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
