"""The model runner's persistent per-request state, kept in preallocated numpy arrays.

The scheduler sends each request's prompt once (`NewRequestData`) and afterwards only its progress and
new blocks (`CachedRequestData`), so the runner must remember every request it knows: its tokens
(prompt, then the tokens the runner itself sampled), its block table row, how many tokens are in the
KV cache, and its sampling parameters. Each request owns one row of every array; a freed row is
reused by the next new request, so nothing is reallocated while serving. The per-step input
preparation (`InputPreparer.prepare`) then gathers from these arrays with vectorized numpy
indexing over the flattened batch instead of walking Python lists per token.
"""

from __future__ import annotations

import numpy as np

from pagedllm.core.sched_output import NewRequestData
from pagedllm.sampling_params import SamplingParams


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_num_blocks_per_req = max_num_blocks_per_req
        # One spare column: the token sampled when a request reaches max_model_len is still recorded
        # (the scheduler then finishes it with "length").
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs
        self.req_id_to_row: dict[str, int] = {}
        # Lowest rows first, so a small batch stays in the first rows of the arrays.
        self._free_rows: list[int] = list(range(max_num_reqs - 1, -1, -1))

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_row)

    def add_request(self, req: NewRequestData) -> int:
        if req.req_id in self.req_id_to_row:
            raise ValueError(f"request {req.req_id!r} is already in the model runner's batch")
        n = len(req.token_ids)
        if n > self.max_model_len:
            raise ValueError(
                f"request {req.req_id!r} has {n} tokens, more than max_model_len={self.max_model_len}"
            )
        if len(req.block_ids) > self.max_num_blocks_per_req:
            raise ValueError(
                f"request {req.req_id!r} has {len(req.block_ids)} blocks, more than the "
                f"{self.max_num_blocks_per_req} a max_model_len sequence needs"
            )
        if not self._free_rows:
            raise RuntimeError(
                f"the model runner's batch is full ({self.max_num_reqs} requests, max_num_seqs)"
            )
        row = self._free_rows.pop()
        self.req_id_to_row[req.req_id] = row
        self.req_ids[row] = req.req_id
        self.sampling_params[row] = req.sampling_params
        self.token_ids[row, :n] = req.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = req.num_prompt_tokens
        self.num_computed_tokens[row] = req.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, req.block_ids)
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Drop a request's state; returns its freed row (None when the runner did not know it, e.g.
        a request aborted before it was ever scheduled)."""
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return None
        self.req_ids[row] = None
        self.sampling_params[row] = None
        self._free_rows.append(row)
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"request {self.req_ids[row]!r} would hold {end} blocks, more than the "
                f"{self.max_num_blocks_per_req} a max_model_len sequence needs"
            )
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def write_scheduled_tokens(self, row: int, start: int, token_ids: list[int]) -> None:
        """Record a step's input tokens from `start` on, as the scheduler sent them (pipeline
        parallelism: the ranks that do not sample learn the sampled tokens this way)."""
        end = start + len(token_ids)
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = max(self.num_tokens[row], end)

    def append_sampled_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Record one sampled token for each of `rows` (vectorized)."""
        if rows.size == 0:
            return
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def output_token_ids(self, row: int) -> np.ndarray:
        """The tokens generated so far (a view; the sampler's penalties read it)."""
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]]

    def prompt_token_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, : self.num_prompt_tokens[row]]

