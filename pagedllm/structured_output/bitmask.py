"""Applying the step's grammar bitmask to the logits (in the model runner, before sampling).

This runs every step with a constrained request, over [rows, vocab] logits, so it touches each logit
once: the packed words unpack to one byte per token in numpy's C loop, and a single in-place
`masked_fill_` writes -inf (on a contiguous run of rows, the usual case, without gathering them).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.sched_output import GrammarOutput


def forbidden_tokens(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [rows, vocab_size], True where the token is NOT allowed, from int32 [rows, ceil(vocab / 32)]
    where bit j of word w allows token 32w+j."""
    # As little-endian bytes, bit j of word w is bit j % 8 of byte 4w + j // 8: numpy unpacks it in order.
    words = np.ascontiguousarray(~np.asarray(bitmask, dtype="<i4"))
    return np.unpackbits(words.view(np.uint8), axis=1, count=vocab_size, bitorder="little").view(bool)


def apply_grammar_bitmask(logits: torch.Tensor, grammar_output: GrammarOutput, req_ids: list[str]) -> None:
    """Set to -inf, in place, the logits of the tokens each constrained request's grammar forbids.
    ``logits`` [len(req_ids), vocab]: row i belongs to req_ids[i]; requests without a row in the
    bitmask (unconstrained, or not sampling) are left alone."""
    row_of = {req_id: i for i, req_id in enumerate(req_ids)}
    rows: list[int] = []
    mask_rows: list[int] = []
    for j, req_id in enumerate(grammar_output.structured_output_request_ids):
        if req_id in row_of:
            rows.append(row_of[req_id])
            mask_rows.append(j)
    if not rows:
        return
    bitmask = np.asarray(grammar_output.grammar_bitmask)
    if mask_rows != list(range(len(bitmask))):
        bitmask = bitmask[mask_rows]
    forbidden = torch.from_numpy(forbidden_tokens(bitmask, logits.shape[1])).to(logits.device)
    first = rows[0]
    if rows == list(range(first, first + len(rows))):
        logits[first : first + len(rows)].masked_fill_(forbidden, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
