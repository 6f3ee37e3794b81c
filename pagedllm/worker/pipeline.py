"""One pipeline stage's forward: receive the previous stage's hidden states, run this stage's
layers, send the result on.

Stages run a step in lock-step: every rank executes the same scheduler output, so each knows the
step's token count and the shapes of what it receives (`[tokens, hidden]`, twice: the hidden states
and the residual stream), and nothing but the tensors themselves crosses between stages. The last
stage returns the final hidden states; the others return theirs only as the step's (unused) hidden
output, since they compute no logits.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed import parallel_state


class PipelineStageForward:
    def __init__(self, model: nn.Module, hidden_size: int, dtype: torch.dtype) -> None:
        self.model = model
        self.hidden_size = hidden_size
        self.dtype = dtype

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        pp = parallel_state.get_pp_group()
        intermediate = None
        if not pp.is_first_rank:
            shape = (input_ids.shape[0], self.hidden_size)
            prev = pp.rank_in_group - 1
            hidden = pp.recv(shape, self.dtype, input_ids.device, src=prev)
            intermediate = (hidden, pp.recv(shape, self.dtype, input_ids.device, src=prev))
        out = self.model(input_ids, positions, intermediate)
        if pp.is_last_rank:
            return out
        hidden, residual = out
        pp.send(hidden, dst=pp.rank_in_group + 1)
        pp.send(residual, dst=pp.rank_in_group + 1)
        return hidden
