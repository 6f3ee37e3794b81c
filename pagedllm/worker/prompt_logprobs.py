"""Prompt logprobs: the logprob of each prompt token given the tokens before it, chunk by chunk.

Kept across preemption (dropped only when the request finishes), so a resumed request does not send
the same prompt positions twice.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.core.runner_output import LogprobsLists
from pagedllm.sample.logprobs import compute_prompt_logprobs
from pagedllm.worker.input_batch import InputBatch

# Prompt-logprobs rows are turned into [rows, vocab] logits this many at a time, so a long prompt chunk
# does not materialize a chunk-sized float32 vocabulary matrix at once.
_ROWS_PER_CHUNK = 1024


class PromptLogprobs:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Request id -> the first prompt position whose logprobs are still to be sent.
        self._next: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self._next)

    def track(self, req_id: str, num_computed_tokens: int) -> None:
        """Start (or, after preemption, keep) sending `req_id`'s prompt logprobs."""
        self._next.setdefault(req_id, num_computed_tokens)

    def forget(self, req_id: str) -> None:
        self._next.pop(req_id, None)

    def compute(
        self,
        model: nn.Module,
        hidden: torch.Tensor,
        batch: InputBatch,
        req_ids: list[str],
        rows: np.ndarray,
        query_start_loc: np.ndarray,
    ) -> dict[str, LogprobsLists | None]:
        """Logprobs of this step's prompt positions for every tracked request (the first prompt token
        has none). Requests with prompt logprobs are few; the loop is per request."""
        out: dict[str, LogprobsLists | None] = {}
        for i, req_id in enumerate(req_ids):
            start_pos = self._next.get(req_id)
            if start_pos is None:
                continue
            row = int(rows[i])
            computed = int(batch.num_computed_tokens[row])
            first, last = int(query_start_loc[i]), int(query_start_loc[i + 1])
            # Positions p predict the prompt token p + 1; the last prompt position predicts an output.
            begin = max(start_pos, computed)
            end = min(computed + last - first, int(batch.num_prompt_tokens[row]) - 1)
            if end <= begin:
                continue
            params = batch.sampling_params[row]
            assert params is not None and params.prompt_logprobs is not None
            parts = []
            for lo in range(begin, end, _ROWS_PER_CHUNK):
                hi = min(lo + _ROWS_PER_CHUNK, end)
                logits = model.compute_logits(hidden[first + lo - computed : first + hi - computed])
                targets = torch.from_numpy(batch.token_ids[row, lo + 1 : hi + 1]).to(self.device)
                parts.append(compute_prompt_logprobs(logits, targets, params.prompt_logprobs).tolists())
            out[req_id] = LogprobsLists(
                token_ids=[t for p in parts for t in p.token_ids],
                logprobs=[lp for p in parts for lp in p.logprobs],
                sampled_token_ranks=[r for p in parts for r in p.sampled_token_ranks],
            )
            self._next[req_id] = end
        return out
