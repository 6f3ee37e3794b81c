"""The grammar bitmask on the logits: exactly the disallowed tokens of the constrained rows become -inf."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.sched_output import GrammarOutput
from pagedllm.structured_output.bitmask import apply_grammar_bitmask, forbidden_tokens


def pack(allowed: np.ndarray) -> np.ndarray:
    """int32 words from a bool [rows, vocab] (the reference packing, bit by bit)."""
    rows, vocab = allowed.shape
    words = np.zeros((rows, (vocab + 31) // 32), dtype=np.uint32)
    for r in range(rows):
        for t in np.flatnonzero(allowed[r]):
            words[r, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return words.view(np.int32)


def test_unpack_round_trips_every_bit_including_the_sign_bit() -> None:
    rng = np.random.default_rng(0)
    allowed = rng.random((3, 100)) < 0.5
    allowed[:, 31] = True  # bit 31 of word 0: the int32 sign bit
    allowed[1, 63] = False
    assert np.array_equal(forbidden_tokens(pack(allowed), 100), ~allowed)


def test_a_contiguous_run_of_rows_is_masked_in_place() -> None:
    rng = np.random.default_rng(2)
    vocab = 100
    logits = torch.randn(4, vocab)
    expected = logits.clone()
    storage = logits.data_ptr()
    allowed = rng.random((2, vocab)) < 0.3
    apply_grammar_bitmask(logits, GrammarOutput(["b", "c"], pack(allowed)), ["a", "b", "c", "d"])
    expected[1:3][~torch.from_numpy(allowed)] = float("-inf")
    assert torch.equal(logits, expected) and logits.data_ptr() == storage


def test_only_constrained_rows_are_masked_by_request_id() -> None:
    rng = np.random.default_rng(1)
    vocab = 70
    logits = torch.randn(4, vocab)
    original = logits.clone()
    allowed = rng.random((2, vocab)) < 0.3
    # The bitmask rows are in the scheduler's order, which need not be the runner's.
    output = GrammarOutput(["c", "a"], pack(allowed))
    apply_grammar_bitmask(logits, output, ["a", "b", "c", "d"])
    expected = original.clone()
    expected[2][~torch.from_numpy(allowed[0])] = float("-inf")
    expected[0][~torch.from_numpy(allowed[1])] = float("-inf")
    assert torch.equal(logits, expected)


def test_a_request_not_in_the_batch_is_skipped() -> None:
    logits = torch.zeros(1, 40)
    apply_grammar_bitmask(logits, GrammarOutput(["gone"], np.zeros((1, 2), dtype=np.int32)), ["here"])
    assert torch.equal(logits, torch.zeros(1, 40))
