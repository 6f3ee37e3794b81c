"""The n-gram (prompt lookup) drafter on hand-made token sequences."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.spec_decode.proposers.ngram import NgramProposer


def _ids(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


def test_ngram_longest_then_latest_match() -> None:
    ngram = NgramProposer(min_n=1, max_n=3)
    # The ending [2, 3] occurs twice before; [1, 2, 3] (longer) only at the start: that one wins.
    seq = _ids(1, 2, 3, 7, 8, 9, 5, 2, 3, 4, 4, 1, 2, 3)
    assert ngram.draft("r", seq, 3) == [7, 8, 9]
    # Equally long matches: the latest one's continuation.
    assert ngram.draft("r", _ids(5, 1, 6, 5, 2, 6, 5), 2) == [2, 6]
    # The drafts stop at the end of the sequence, and k bounds them.
    assert ngram.draft("r", _ids(4, 5, 6, 4), 5) == [5, 6, 4]
    assert ngram.draft("r", _ids(4, 5, 6, 4), 1) == [5]


def test_ngram_respects_min_length() -> None:
    ngram = NgramProposer(min_n=2, max_n=4)
    assert ngram.draft("r", _ids(1, 2, 3, 9, 2), 3) == []  # only a 1-token match
    assert ngram.draft("r", _ids(1, 2, 3, 9, 1, 2), 3) == [3, 9, 1]
    assert ngram.draft("r", _ids(1, 2), 3) == []
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)
