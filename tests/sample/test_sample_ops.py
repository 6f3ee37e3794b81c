"""The batched logit transforms against straightforward per-row references."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample.ops import (
    apply_min_p,
    apply_top_k_top_p,
    apply_top_k_top_p_sorted,
    apply_top_p_partial,
    exponential_race,
    inverse_cdf_sample,
    random_sample,
)


def test_top_k_only_path_equals_sorted_path() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[2, :5] = 3.0  # ties at the k-th value are kept by both paths
    top_k = torch.tensor([1, 5, 3, 50, 17, 49])
    fast = apply_top_k_top_p(logits.clone(), top_k, None)
    assert torch.equal(fast, apply_top_k_top_p(logits.clone(), top_k, None, max_top_k=49))
    sorted_path = apply_top_k_top_p(logits.clone(), top_k, torch.ones(6))
    assert torch.equal(torch.isinf(fast), torch.isinf(sorted_path))
    kept = (~torch.isinf(fast)).sum(-1).tolist()
    assert kept == [1, 5, 5, 50, 17, 49]


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.97, 0.01, 0.01, 0.01]])
    out = apply_top_k_top_p(probs.log(), None, torch.tensor([0.75, 0.85, 0.5]))
    assert (~torch.isinf(out)).tolist() == [
        [True, True, False, False],
        [True, True, True, False],
        [True, False, False, False],
    ]


def test_top_k_then_top_p_renormalizes() -> None:
    # After top-k 2 the renormalized probabilities are 0.625 / 0.375: top-p 0.6 keeps only the first.
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    out = apply_top_k_top_p(probs.log(), torch.tensor([2]), torch.tensor([0.6]))
    assert (~torch.isinf(out)).tolist() == [[True, False, False]]
    out = apply_top_k_top_p(probs.log(), torch.tensor([3]), torch.tensor([0.6]))
    assert (~torch.isinf(out)).tolist() == [[True, True, False]]


def test_min_p_equals_probability_definition() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 100) * 3
    min_p = torch.tensor([0.0, 0.01, 0.05, 0.1, 0.3, 0.5, 0.9, 1.0])
    probs = logits.softmax(-1)
    reference = probs < probs.amax(-1, keepdim=True) * min_p.unsqueeze(1)
    out = apply_min_p(logits.clone(), min_p)
    assert torch.equal(torch.isinf(out), reference)


def test_random_sample_seeded_rows_ignore_the_rest() -> None:
    probs = torch.full((4, 10), 0.1)
    gens = {1: torch.Generator().manual_seed(5), 3: torch.Generator().manual_seed(6)}
    torch.manual_seed(0)
    first = random_sample(probs.clone(), gens)
    gens = {1: torch.Generator().manual_seed(5), 3: torch.Generator().manual_seed(6)}
    torch.manual_seed(1)
    second = random_sample(probs.clone(), gens)
    assert first[1] == second[1] and first[3] == second[3]
    # Zero-probability tokens are never drawn.
    masked = torch.zeros(5000, 10)
    masked[:, 3] = 0.4
    masked[:, 8] = 0.6
    assert set(random_sample(masked, {}).tolist()) == {3, 8}


def test_partial_top_p_equals_sorted_kernel() -> None:
    torch.manual_seed(2)
    vocab = 6000
    # Cut-offs within the first 256 candidates, within 4096, and beyond (the full-sort fallback).
    scales = torch.tensor([4.0] * 6 + [1.0] * 2 + [0.05] * 3).unsqueeze(1)
    logits = torch.randn(11, vocab) * scales
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.99, 0.2, 0.95, 0.9, 0.8, 0.99, 1.0, 0.3])
    top_k = torch.tensor([vocab, 40, 300, vocab, 3, 1000, vocab, vocab, vocab, 10, vocab])
    for k, max_k in ((None, 0), (top_k, 1000)):
        partial = apply_top_p_partial(logits.clone(), k, top_p, max_k)
        reference = apply_top_k_top_p_sorted(logits.clone(), k, top_p)
        assert torch.equal(torch.isinf(partial), torch.isinf(reference))
    kept = (~torch.isinf(partial)).sum(-1)
    assert kept[2] == 300 and kept[9] == 10 and kept[4] <= 3
    assert 256 < kept[6] <= 4096 and kept[8] > 4096


@pytest.mark.parametrize("draw", [exponential_race, inverse_cdf_sample])
def test_both_draws_follow_the_distribution(draw) -> None:
    p = torch.tensor([0.5, 0.0, 0.25, 0.15, 0.1, 0.0])
    torch.manual_seed(0)
    n = 20_000
    sampled = draw(p.repeat(n, 1), {3: torch.Generator().manual_seed(1)})
    counts = torch.bincount(sampled, minlength=6).double() / n
    assert counts[1] == 0 and counts[5] == 0
    assert 0.5 * (counts - p.double()).abs().sum() < 0.02
