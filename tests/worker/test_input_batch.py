"""InputBatch: persistent rows, block tables and recorded tokens."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.core.sched_output import NewRequestData
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch

PARAMS = SamplingParams(temperature=0.0)


def new(req_id: str, tokens: list[int], blocks: list[int], num_prompt: int | None = None) -> NewRequestData:
    return NewRequestData(
        req_id, tokens, len(tokens) if num_prompt is None else num_prompt, PARAMS, blocks, 0
    )


def test_rows_are_reused_lowest_first() -> None:
    batch = InputBatch(max_num_reqs=3, max_model_len=32, max_num_blocks_per_req=2)
    assert [batch.add_request(new(r, [1, 2], [r_i])) for r_i, r in enumerate("abc")] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="batch is full"):
        batch.add_request(new("d", [1], [0]))
    assert batch.remove_request("b") == 1
    assert batch.remove_request("never-seen") is None
    assert batch.add_request(new("d", [9, 9, 9], [7])) == 1
    assert batch.num_reqs == 3 and batch.req_ids == ["a", "d", "c"]
    assert batch.num_tokens[1] == 3 and list(batch.block_table[1, :1]) == [7]


def test_resumed_request_keeps_prompt_and_output_apart() -> None:
    batch = InputBatch(max_num_reqs=2, max_model_len=32, max_num_blocks_per_req=2)
    row = batch.add_request(new("a", [5, 6, 7, 8, 9], [3], num_prompt=3))
    assert list(batch.prompt_token_ids(row)) == [5, 6, 7]
    assert list(batch.output_token_ids(row)) == [8, 9]


def test_blocks_and_sampled_tokens_append() -> None:
    batch = InputBatch(max_num_reqs=2, max_model_len=32, max_num_blocks_per_req=2)
    a = batch.add_request(new("a", [1, 2], [4]))
    b = batch.add_request(new("b", [3], [5]))
    batch.append_blocks(a, [6])
    assert list(batch.block_table[a]) == [4, 6]
    with pytest.raises(ValueError, match="more than the 2"):
        batch.append_blocks(a, [8])
    batch.append_sampled_tokens(np.array([b, a]), np.array([30, 20]))
    assert list(batch.output_token_ids(a)) == [20] and list(batch.output_token_ids(b)) == [30]
    assert list(batch.token_ids[a, :3]) == [1, 2, 20]


def test_oversized_request_is_refused() -> None:
    batch = InputBatch(max_num_reqs=2, max_model_len=4, max_num_blocks_per_req=1)
    with pytest.raises(ValueError, match="max_model_len=4"):
        batch.add_request(new("a", [1] * 5, [0]))
    with pytest.raises(ValueError, match="2 blocks"):
        batch.add_request(new("a", [1], [0, 1]))
    with pytest.raises(ValueError, match="already"):
        batch.add_request(new("b", [1], [0]))
        batch.add_request(new("b", [1], [0]))
