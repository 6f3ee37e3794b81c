"""Logprob gathering (sampled token first, then the top-k, with ranks) and prompt logprobs."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample.logprobs import compute_prompt_logprobs, gather_logprobs


def test_gather_logprobs_layout_and_ranks() -> None:
    logprobs = torch.tensor([[-0.1, -2.0, -3.0, -1.0], [-1.0, -1.2, -0.5, -1.2]])
    out = gather_logprobs(logprobs, 2, torch.tensor([2, 1]))
    assert out.logprob_token_ids.tolist() == [[2, 0, 3], [1, 2, 0]]
    torch.testing.assert_close(out.logprobs, torch.tensor([[-3.0, -0.1, -1.0], [-1.2, -0.5, -1.0]]))
    # Rank 1 = most likely; a tie with a better-or-equal token counts against the token.
    assert out.selected_token_ranks.tolist() == [4, 4]
    lists = out.tolists(num_logprobs=1)
    assert lists.token_ids == [[2, 0], [1, 2]] and lists.sampled_token_ranks == [4, 4]
    assert gather_logprobs(logprobs, 0, torch.tensor([0, 0])).logprobs.shape == (2, 1)


def test_prompt_logprobs_match_log_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 30)
    targets = torch.tensor([3, 7, 7, 0, 29])
    out = compute_prompt_logprobs(logits, targets, 4)
    ref = torch.log_softmax(logits.double(), -1)
    for i, t in enumerate(targets.tolist()):
        assert out.logprob_token_ids[i, 0] == t
        assert float(out.logprobs[i, 0]) == pytest.approx(float(ref[i, t]), abs=1e-5)
        assert int(out.selected_token_ranks[i]) == int((ref[i] >= ref[i, t]).sum())
        assert out.logprob_token_ids[i, 1:].tolist() == ref[i].topk(4).indices.tolist()
    assert compute_prompt_logprobs(logits, targets, -1).logprobs.shape == (5, 31)
