"""The prompt or output tokens of some rows of the runner's batch, as the sampling metadata builder
reads them (penalties, bad words, min_tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, overload

import numpy as np


class TokenRows(Protocol):
    """The runner's persistent batch as sampling reads it (`pagedllm.worker.input_batch.InputBatch`):
    each row's tokens so far, their count and the prompt's."""

    token_ids: np.ndarray
    num_tokens: np.ndarray
    num_prompt_tokens: np.ndarray

    def prompt_token_ids(self, row: int) -> np.ndarray: ...

    def output_token_ids(self, row: int) -> np.ndarray: ...


class RowTokens(Sequence[np.ndarray]):
    """The prompt (or output) token ids of some batch rows, as views made on access: the sampling
    metadata builder only touches them for penalties, bad words and min_tokens, so a plain batch pays
    nothing for building them."""

    def __init__(self, batch: TokenRows, rows: list[int], output: bool) -> None:
        self._batch = batch
        self._rows = rows
        self._output = output

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, i: slice) -> list[np.ndarray]: ...
    def __getitem__(self, i: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._tokens(i)

    def _tokens(self, i: int) -> np.ndarray:
        row = self._rows[i]
        if self._output:
            return self._batch.output_token_ids(row)
        return self._batch.prompt_token_ids(row)
