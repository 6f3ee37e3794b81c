"""The suffix-decoding drafter on hand-made token sequences."""

from __future__ import annotations

import numpy as np

from pagedllm.spec_decode.proposers.suffix import SuffixProposer


def _ids(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


def test_suffix_follows_the_most_frequent_continuation() -> None:
    suffix = SuffixProposer(max_depth=8, max_cached_requests=0, max_spec_factor=4.0, min_token_prob=0.1)
    # After [1, 2] came 3 twice and 4 once: draft 3, then what followed [.., 2, 3].
    seq = _ids(1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 4, 6, 1, 2)
    assert suffix.draft("a", seq, 3) == [3, 5, 1]
    # Grown by one token (incrementally), the match follows.
    assert suffix.draft("a", np.append(seq, 3), 2) == [5, 1]
    # max_spec_factor bounds drafts by the match length (a 1-token match drafts 1 token at factor 1).
    short = SuffixProposer(max_depth=8, max_cached_requests=0, max_spec_factor=1.0, min_token_prob=0.1)
    assert short.draft("b", _ids(7, 8, 9, 1, 7), 4) == [8]


def test_suffix_min_token_prob_and_global_cache() -> None:
    suffix = SuffixProposer(max_depth=8, max_cached_requests=1, max_spec_factor=4.0, min_token_prob=0.6)
    # 2 was followed by 3 and by 4 once each: probability 0.5 < 0.6, no draft.
    assert suffix.draft("a", _ids(2, 3, 2, 4, 2), 3) == []
    suffix.forget("a", _ids(10, 11, 12, 13))
    # A new request ending like the cached output drafts its continuation.
    assert suffix.draft("b", _ids(5, 10, 11), 3) == [12, 13]
    # Only one output is kept: caching another evicts the first.
    suffix.forget("b", _ids(20, 21, 22))
    assert suffix.draft("c", _ids(10, 11), 3) == []
    assert suffix.draft("c2", _ids(20), 3) == [21, 22]


def test_suffix_prefers_the_match_expected_to_accept_more() -> None:
    # Depth 4: the 2-token match "2 3" can walk 2 tokens, the 1-token match "3" walks 3 with the same
    # certainty; the longest match alone would draft [4, 5].
    suffix = SuffixProposer(max_depth=4, max_cached_requests=0, max_spec_factor=4.0, min_token_prob=0.1)
    assert suffix.draft("a", _ids(1, 2, 3, 4, 5, 6, 9, 2, 3), 3) == [4, 5, 6]


def test_suffix_ties_go_to_the_latest_continuation() -> None:
    suffix = SuffixProposer(max_depth=8, max_cached_requests=0, max_spec_factor=4.0, min_token_prob=0.1)
    # 1 was followed by 5, then by 6: copied text continues the way it did last.
    assert suffix.draft("a", _ids(1, 5, 1, 6, 1), 2) == [6, 1]


def test_suffix_global_trie_forgets_evicted_continuations() -> None:
    suffix = SuffixProposer(max_depth=8, max_cached_requests=1, max_spec_factor=4.0, min_token_prob=0.1)
    suffix.forget("a", _ids(10, 11, 10, 11))
    suffix.forget("b", _ids(10, 13))  # evicts "a": 10 was followed by 11 only there
    assert suffix.draft("c", _ids(10), 2) == [13]
