"""How many tokens to draft: per batch size (`DraftLength`, the schedule and the compute-bound
off-switch), and per request from its acceptance history (`DraftControl`): draft only what pays for
its verification.

Each request keeps ``a``, an estimate of the probability that a draft is accepted given the drafts
before it were: discounted counts (weight ``DECAY`` per observation) of accepted drafts over tried
ones, where a try is every accepted draft plus the first rejected one. Drafting n tokens is then
expected to add ``a + a^2 + ... + a^n`` tokens to a step, while verifying them costs
``VERIFY_BASE + VERIFY_PER_DRAFT * n`` of a plain decode step (the target's forward of 1 + n rows
against the one-row step). A request drafts the n in 0..k with the largest expected gain less cost:
on copied text (a near 1) all k, on open-ended text (most drafts rejected) none.

The history is kept up when a request drafts nothing: the token drafters are asked every step and
their proposal is remembered as a *shadow* draft, which the request's next tokens (decoded without
it) accept or reject exactly as a verification would have (greedy: the same tokens). So a request
that stops drafting on open-ended text resumes as soon as its output starts copying a span, and
every decision depends on the request's tokens alone (never on timing: seeded runs reproduce).

Model drafters (draft_model, EAGLE) pay their own forward for every draft, so they are not asked
for shadows: they draft ``max(1, round(k * a))`` tokens, fewer where drafts keep failing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# The off-switch: a verification step runs at most this many target tokens (requests x (1 + drafts)).
# Up to it a CPU forward of the decode batch costs about the same per step whatever its token count
# (streaming the weights dominates); beyond it the step is compute-bound and every rejected draft is
# paid in full, so the draft length shrinks to fit and drafting stops when not even one draft fits.
# Measured with `bench latency` on SmolLM2-135M Q4_1, 2 cores (benchmarks/RESULTS.md, speculative).
SPEC_MAX_STEP_TOKENS = 32


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


# The verification cost model, in plain decode steps: a step that verifies n drafts costs
# 1 + VERIFY_BASE + VERIFY_PER_DRAFT * n, fitted to the step times of `bench latency --dataset
# grounded` at the compiled default (benchmarks/RESULTS.md, "Figures behind code choices").
VERIFY_BASE = 0.2
VERIFY_PER_DRAFT = 0.08
# Weight of the history against each new observation (0.75 against 0.0-0.5: a little more of the
# grounded benchmark's speed-up in an offline replay of its greedy outputs, the same on chat).
DECAY = 0.75


def expected_gain(acceptance: float, num_drafts: int) -> float:
    """Expected accepted tokens of ``num_drafts`` drafts, each accepted with probability
    ``acceptance`` given the ones before it were: a + a^2 + ... + a^n."""
    return sum(acceptance**i for i in range(1, num_drafts + 1))


def best_length(acceptance: float, k: int, base: float = VERIFY_BASE, per_draft: float = VERIFY_PER_DRAFT) -> int:
    """The n in 0..k with the largest expected gain less verification cost (0: drafting does not pay)."""
    best, best_net = 0, 0.0
    for n in range(1, k + 1):
        net = expected_gain(acceptance, n) - base - per_draft * n
        if net > best_net:
            best, best_net = n, net
    return best


@dataclass
class _History:
    # Discounted accepted drafts and tries; the prior (1/1) lets a new request draft at once.
    accepted: float = 1.0
    tried: float = 1.0
    # The drafts (verified, or a shadow) still to be scored against the request's tokens, and the
    # sequence length they continue.
    pending: list[int] | None = None
    start: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tried

    def observe(self, num_accepted: int, num_drafts: int) -> None:
        tries = num_accepted + (1 if num_accepted < num_drafts else 0)
        self.accepted = DECAY * self.accepted + num_accepted
        self.tried = DECAY * self.tried + tries

    def score_pending(self, token_ids: np.ndarray) -> bool:
        """Score the pending drafts against the tokens that followed them, once those decide them
        (a mismatch, or as many tokens as drafts); returns whether nothing is pending any more."""
        if self.pending is None:
            return True
        drafts = np.asarray(self.pending, dtype=token_ids.dtype)
        following = token_ids[self.start : self.start + drafts.size]
        mismatch = np.flatnonzero(following != drafts[: following.size])
        if mismatch.size:
            self.observe(int(mismatch[0]), drafts.size)
        elif following.size == drafts.size:
            self.observe(drafts.size, drafts.size)
        else:
            return False
        self.pending = None
        return True


class DraftControl:
    """Per request: how many drafts to verify this step (``length``) and what was drafted
    (``record``). ``shadows``: the drafter is asked every step (token drafters); else a request
    drafts at least one token while the batch allows any."""

    def __init__(self, shadows: bool) -> None:
        self.shadows = shadows
        self.requests: dict[str, _History] = {}

    def length(self, req_id: str, token_ids: np.ndarray, k: int) -> int:
        """Drafts the request verifies this step, of the ``k`` the batch allows; ``token_ids`` is the
        request's sequence so far (which scores earlier drafts)."""
        h = self.requests.setdefault(req_id, _History())
        h.score_pending(token_ids)
        if k <= 0:
            return 0
        if self.shadows:
            return best_length(h.acceptance, k)
        return max(1, round(k * h.acceptance))

    def wants_shadow(self, req_id: str) -> bool:
        """Whether a request that verifies nothing this step should still be asked for drafts (to
        score them against its next tokens): a token drafter with no drafts awaiting their score."""
        h = self.requests.get(req_id)
        return self.shadows and h is not None and h.pending is None

    def record(self, req_id: str, drafts: list[int], start: int) -> None:
        """The drafts (verified or shadow) proposed to continue the request's first ``start`` tokens."""
        h = self.requests.setdefault(req_id, _History())
        if drafts and h.pending is None:
            h.pending, h.start = list(drafts), start

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
