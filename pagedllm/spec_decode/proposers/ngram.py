"""Prompt-lookup (n-gram) drafting: continue the sequence the way it continued after the last place
where its current ending occurred before.

The sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up
in the prompt and the output so far; the longest match wins (the most recent one among equally long
matches), and the tokens that followed it are the drafts. This is what makes summarize / rewrite /
edit prompts fast: the output copies spans of the input. All matching is numpy over the whole
sequence, no per-token Python loop.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedllm.spec_decode.proposers.token_proposer import TokenProposer


class NgramProposer(TokenProposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        super().__init__()
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min={min_n} must be in 1..prompt_lookup_max={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def draft(self, req_id: str, token_ids: np.ndarray, k: int) -> list[int]:
        n_min = self.min_n
        length = token_ids.size
        if k <= 0 or length <= n_min:
            return []
        # Start positions p of every earlier occurrence of the last n_min tokens that has at least one
        # token after it (p + n_min < length excludes the ending itself).
        windows = sliding_window_view(token_ids[: length - 1], n_min)
        starts = np.flatnonzero((windows == token_ids[length - n_min :]).all(axis=1))
        if starts.size == 0:
            return []
        # Extend each match backwards, up to max_n tokens in all.
        match_len = np.full(starts.size, n_min, dtype=np.int64)
        alive = np.ones(starts.size, dtype=bool)
        for extra in range(1, self.max_n - n_min + 1):
            before = starts - extra
            ok = alive & (before >= 0)
            ok[ok] = token_ids[before[ok]] == token_ids[length - n_min - extra]
            match_len += ok
            alive = ok
            if not alive.any():
                break
        # The longest match; the latest among equals (argmax of the reversed array finds the last).
        best = starts.size - 1 - int(np.argmax(match_len[::-1]))
        follow = int(starts[best]) + n_min
        return token_ids[follow : follow + k].tolist()
