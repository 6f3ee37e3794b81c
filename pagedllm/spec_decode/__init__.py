"""Speculative decoding: drafters that propose tokens for the target model to verify in one forward.

`make_proposer` builds the drafter a `SpeculativeConfig` names; `DraftLength` decides how many tokens
to draft at a given batch size (the `num_speculative_tokens_per_batch_size` schedule and the
compute-bound off-switch), and `draft_control.DraftControl` how many of those each request verifies
(those whose expected acceptance pays for the verification, from the request's own history).
Verification is `pagedllm.sample.rejection_sampler`; the model runner's side is
`pagedllm.worker.spec_decode`.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.suffix import SuffixProposer

# The off-switch: a verification step runs at most this many target tokens (requests x (1 + drafts)).
# Up to it a CPU forward of the decode batch costs about the same per step whatever its token count
# (streaming the weights dominates); beyond it the step is compute-bound and every rejected draft is
# paid in full, so the draft length shrinks to fit and drafting stops when not even one draft fits.
# Measured with `bench latency` on SmolLM2-135M Q4_1, 2 cores (benchmarks/RESULTS.md, speculative).
SPEC_MAX_STEP_TOKENS = 32


class Proposer(Protocol):
    def propose(self, req_id: str, token_ids: np.ndarray, k: int) -> list[int]: ...

    def forget(self, req_id: str, output_token_ids: np.ndarray | None) -> None: ...


def make_proposer(spec_config: Any) -> Proposer:
    method = spec_config.method
    if method == "ngram":
        return NgramProposer(spec_config.prompt_lookup_min, spec_config.prompt_lookup_max)
    if method == "suffix":
        return SuffixProposer(
            spec_config.suffix_decoding_max_tree_depth,
            spec_config.suffix_decoding_max_cached_requests,
            spec_config.suffix_decoding_max_spec_factor,
            spec_config.suffix_decoding_min_token_prob,
        )
    raise ValueError(f"speculative_config.method={method!r} has no token-based drafter (ngram, suffix)")


class DraftLength:
    """Tokens to draft per request for a batch of n requests: the configured length (or the
    `num_speculative_tokens_per_batch_size` schedule's), capped so the step stays within
    `max_step_tokens` target tokens."""

    def __init__(self, spec_config: Any, max_num_reqs: int, max_step_tokens: int = SPEC_MAX_STEP_TOKENS) -> None:
        self.k: int = spec_config.num_speculative_tokens
        self.schedule = (
            spec_config.dense_draft_lengths(max_num_reqs)
            if spec_config.uses_dynamic_speculative_decoding()
            else None
        )
        self.max_step_tokens = max_step_tokens

    def __call__(self, num_reqs: int) -> int:
        if num_reqs <= 0:
            return 0
        k = self.k if self.schedule is None else self.schedule[min(num_reqs, len(self.schedule) - 1)]
        return max(0, min(k, self.max_step_tokens // num_reqs - 1))
