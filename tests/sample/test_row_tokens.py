"""RowTokens: the prompt or output tokens of chosen batch rows, read through the batch on access."""

from __future__ import annotations

import numpy as np

from pagedllm.sample.row_tokens import RowTokens


class _Batch:
    token_ids = num_tokens = num_prompt_tokens = np.zeros(0)

    def __init__(self) -> None:
        self.prompts = {0: np.asarray([1, 2]), 3: np.asarray([7])}
        self.outputs = {0: np.asarray([5]), 3: np.asarray([8, 9])}
        self.reads = 0

    def prompt_token_ids(self, row: int) -> np.ndarray:
        self.reads += 1
        return self.prompts[row]

    def output_token_ids(self, row: int) -> np.ndarray:
        self.reads += 1
        return self.outputs[row]


def test_rows_in_the_given_order_read_on_access() -> None:
    batch = _Batch()
    prompts = RowTokens(batch, [3, 0], output=False)
    outputs = RowTokens(batch, [3, 0], output=True)
    assert batch.reads == 0 and len(prompts) == 2
    assert prompts[0].tolist() == [7] and prompts[1].tolist() == [1, 2]
    assert [o.tolist() for o in outputs[0:2]] == [[8, 9], [5]]
    assert batch.reads == 4
