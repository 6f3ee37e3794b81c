"""Applying the step's grammar bitmask to the logits (in the model runner, before sampling)."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.sched_output import GrammarOutput

_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size] from int32 [rows, ceil(vocab / 32)]: bit j of word w allows token 32w+j."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_grammar_bitmask(logits: torch.Tensor, grammar_output: GrammarOutput, req_ids: list[str]) -> None:
    """Set to -inf, in place, the logits of the tokens each constrained request's grammar forbids.
    ``logits`` [len(req_ids), vocab]: row i belongs to req_ids[i]; requests without a row in the
    bitmask (unconstrained, or not sampling) are left alone."""
    row_of = {req_id: i for i, req_id in enumerate(req_ids)}
    pairs = [
        (row_of[req_id], j)
        for j, req_id in enumerate(grammar_output.structured_output_request_ids)
        if req_id in row_of
    ]
    if not pairs:
        return
    rows = torch.tensor([p[0] for p in pairs], device=logits.device)
    bitmask = torch.from_numpy(np.ascontiguousarray(grammar_output.grammar_bitmask))
    bitmask = bitmask[[p[1] for p in pairs]].to(logits.device)
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
