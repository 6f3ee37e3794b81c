"""The rejection sampler keeps the target distribution (chi-square over many independent requests in one
batch, tiny vocabulary), greedy verification is the longest matching prefix, and seeds reproduce."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagedllm.sample.rejection_sampler import verify

VOCAB = 5
N = 20000


def _chi2_pvalue(observed: np.ndarray, probs: torch.Tensor) -> float:
    expected = probs.double().numpy()
    return float(chisquare(observed, expected / expected.sum() * observed.sum()).pvalue)


def _batch(p: torch.Tensor, drafts: list[int]) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """N identical requests, each verifying ``drafts`` with target rows ``p`` [len(drafts) + 1, VOCAB]."""
    k = len(drafts)
    probs = p.repeat(N, 1)
    draft_ids = np.tile(np.asarray([*drafts, -1], dtype=np.int64), N)
    cu = np.arange(N + 1, dtype=np.int64) * (k + 1)
    return probs, draft_ids, cu


@pytest.mark.parametrize("method", ["standard", "strict"])
def test_emitted_tokens_follow_the_target(method: str) -> None:
    torch.manual_seed(0)
    p0 = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.3])
    probs, drafts, cu = _batch(torch.stack([p0, p1]), [1])
    out = verify(None, probs, None, drafts, cu, {}, method)
    first = np.asarray([t[0] for t in out.token_ids])
    # The first token is a draw from p0 whether or not the draft (token 1) was accepted.
    assert _chi2_pvalue(np.bincount(first, minlength=VOCAB), p0) > 1e-3
    # The second token exists exactly when the draft was accepted, and is then a draw from p1.
    second = np.asarray([t[1] for t in out.token_ids if len(t) == 2])
    assert np.array_equal(first == 1, np.asarray([len(t) == 2 for t in out.token_ids]))
    assert _chi2_pvalue(np.bincount(second, minlength=VOCAB), p1) > 1e-3
    accepted = second.size / N
    # standard accepts with probability p0(draft) = 0.4; strict only when its own draw is the draft (0.4
    # too for a point-mass drafter).
    assert abs(accepted - 0.4) < 0.02


def test_general_draft_distribution() -> None:
    """min(1, p/q) acceptance and max(p - q, 0) recovery with a drafter that samples from q."""
    torch.manual_seed(1)
    p = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    q = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])
    drafts = torch.multinomial(q, N, replacement=True).numpy()
    probs = torch.stack([p, p]).repeat(N, 1)
    draft_ids = np.stack([drafts, np.full(N, -1)], axis=1).reshape(-1)
    draft_probs = torch.stack([q, torch.zeros(VOCAB)]).repeat(N, 1)
    cu = np.arange(N + 1, dtype=np.int64) * 2
    out = verify(None, probs, None, draft_ids, cu, {}, "standard", draft_probs)
    first = np.asarray([t[0] for t in out.token_ids])
    assert _chi2_pvalue(np.bincount(first, minlength=VOCAB), p) > 1e-3
    # Told the wrong proposal distribution (uniform), the same verification is skewed: the test can fail.
    wrong_q = torch.full((VOCAB,), 1.0 / VOCAB)
    wrong = torch.stack([wrong_q, torch.zeros(VOCAB)]).repeat(N, 1)
    bad = verify(None, probs, None, draft_ids, cu, {}, "standard", wrong)
    bad_first = np.asarray([t[0] for t in bad.token_ids])
    assert _chi2_pvalue(np.bincount(bad_first, minlength=VOCAB), p) < 1e-3


def test_greedy_longest_matching_prefix() -> None:
    greedy = torch.tensor([3, 1, 4, 2, 0, 0, 9])
    # Request 0: drafts [3, 1, 5] against argmax [3, 1, 4, 2] -> accepts 2, then emits 4.
    # Request 1: drafts [7] against argmax [0, 0] -> emits 0. Request 2: no drafts -> emits 9.
    drafts = np.asarray([3, 1, 5, -1, 7, -1, -1])
    cu = np.asarray([0, 4, 6, 7])
    out = verify(greedy, None, None, drafts, cu, {}, "standard")
    assert out.token_ids == [[3, 1, 4], [0], [9]]
    assert out.row_token_ids.tolist() == [3, 1, 4, 0, 0, 0, 9]


def test_mixed_batch_and_seeds_reproduce() -> None:
    p = torch.tensor([[0.2, 0.2, 0.2, 0.2, 0.2]] * 4)
    greedy_ids = torch.tensor([2, 2, 0, 0])
    greedy_rows = torch.tensor([True, True, False, False])
    drafts = np.asarray([2, -1, 3, -1])
    cu = np.asarray([0, 2, 4])

    def run(seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        gens = {2: g, 3: g}
        return verify(greedy_ids, p.clone(), greedy_rows, drafts, cu, gens, "standard").token_ids

    assert run(5)[0] == [2, 2]
    runs = [run(5) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert len({tuple(run(s)[1]) for s in range(20)}) > 1
