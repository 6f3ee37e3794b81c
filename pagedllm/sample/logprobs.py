"""Log probabilities of sampled (or given) tokens with the top-k alternatives and the token's rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.core.runner_output import LogprobsLists


@dataclass
class LogprobsTensors:
    """Per row: column 0 is the sampled/target token, columns 1.. the top-k of the vocabulary."""

    # [num_rows, 1 + k] int64
    logprob_token_ids: torch.Tensor
    # [num_rows, 1 + k] float32
    logprobs: torch.Tensor
    # [num_rows] int64: rank of the column-0 token (1 = most likely; ties count as better).
    selected_token_ranks: torch.Tensor

    def tolists(self, num_logprobs: int | None = None) -> LogprobsLists:
        """All rows as one LogprobsLists, keeping the first ``num_logprobs`` alternatives (None: all)."""
        width = None if num_logprobs is None else 1 + num_logprobs
        return LogprobsLists(
            token_ids=self.logprob_token_ids[:, :width].tolist(),
            logprobs=self.logprobs[:, :width].tolist(),
            sampled_token_ranks=self.selected_token_ranks.tolist(),
        )

    def to_request_lists(self, num_logprobs: list[int | None]) -> list[LogprobsLists | None]:
        """One LogprobsLists per row (one sampled token each), trimmed to that request's own count."""
        # One device->host copy for the whole batch, then plain Python slicing.
        ids = self.logprob_token_ids.tolist()
        lps = self.logprobs.tolist()
        ranks = self.selected_token_ranks.tolist()
        out: list[LogprobsLists | None] = []
        for row, k in enumerate(num_logprobs):
            if k is None:
                out.append(None)
                continue
            out.append(LogprobsLists([ids[row][: 1 + k]], [lps[row][: 1 + k]], [ranks[row]]))
        return out


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """The logprob and rank of ``token_ids`` [num_rows] and the ``num_logprobs`` most likely tokens."""
    token_ids = token_ids.long().unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        token_logprobs = torch.cat([token_logprobs, top_logprobs], dim=1)
    return LogprobsTensors(token_ids, token_logprobs, ranks)


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Prompt logprobs of one request chunk: ``logits`` [T, vocab] at positions i predict
    ``target_token_ids`` [T] (the prompt token at i + 1), from the raw distribution as vLLM.

    ``num_logprobs`` -1 means the whole vocabulary."""
    if num_logprobs == -1:
        num_logprobs = logits.shape[1]
    return gather_logprobs(compute_logprobs(logits), num_logprobs, target_token_ids)
