"""Pooling requests in the scheduler (no model): prefill-only, finished with the runner's pooled output,
their KV blocks freed at once; a prompt may fill the whole context."""

from __future__ import annotations

from fake_runner import assert_all_blocks_free, make_scheduler

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.runner_output import ModelRunnerOutput
from pagedllm.engine.protocol import FinishReason
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


def _pooling_request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=1), None, pooling_params=PoolingParams())


def _pooled(so) -> ModelRunnerOutput:  # type: ignore[no-untyped-def]
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[] for _ in req_ids],
        pooler_output={r: [float(len(r)), 0.5] for r in req_ids},
    )


def test_pooling_requests_finish_after_their_prompt() -> None:
    s = make_scheduler(
        max_model_len=16, max_num_batched_tokens=64, enable_prefix_caching=False, enable_chunked_prefill=False
    )
    s.add_request(_pooling_request("a", list(range(16))))  # the whole context: no room needed for output
    s.add_request(_pooling_request("bb", [1, 2, 3]))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 16, "bb": 3}
    assert so.scheduled_new_reqs[0].pooling_params == PoolingParams()
    outputs = s.update_from_output(so, _pooled(so)).outputs
    assert {o.request_id: (o.finish_reason, o.pooling_output, o.new_token_ids) for o in outputs} == {
        "a": (FinishReason.STOP, [1.0, 0.5], []),
        "bb": (FinishReason.STOP, [2.0, 0.5], []),
    }
    assert not s.has_unfinished_requests()
    assert all(
        r.status == RequestStatus.FINISHED_STOPPED for r in (s.requests.get("a"), s.requests.get("bb")) if r
    )
    assert_all_blocks_free(s)
    # The next step tells the runner to drop them.
    assert s.schedule().finished_req_ids == {"a", "bb"}
