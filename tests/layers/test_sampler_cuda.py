"""The sampler on a CUDA device: seeded rows independent of the batch, greedy rows exact, truncation
exact and the distribution right (skipped without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.layers.sampler import Sampler
from pagedllm.sample.metadata import build_sampling_metadata, make_generator
from pagedllm.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = "cuda"
LOGITS = [2.0, 1.5, 1.2, 0.3, 0.0, -0.4, -1.0, -2.5]
V = len(LOGITS)


def _sample(params: list[SamplingParams], logits: torch.Tensor, generators=None) -> torch.Tensor:
    empty = [[] for _ in params]
    md = build_sampling_metadata(params, empty, empty, generators or {}, V, DEVICE)
    return Sampler()(logits.to(DEVICE), md).sampled_token_ids.cpu()


def test_seeded_rows_independent_of_batch_on_cuda() -> None:
    def run(row: int, batch: int) -> list[int]:
        gens = {row: make_generator(7, DEVICE)}
        params = [SamplingParams(temperature=2.0) for _ in range(batch)]
        params[row] = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
        out = []
        for step in range(20):
            logits = torch.randn(batch, V, generator=torch.Generator().manual_seed(step + batch))
            logits[row] = torch.tensor(LOGITS)
            out.append(int(_sample(params, logits, gens)[row]))
        return out

    alone = run(0, 1)
    assert len(set(alone)) > 1
    assert run(5, 9) == alone and run(30, 32) == alone


def test_distribution_and_greedy_rows_on_cuda() -> None:
    n = 20_000
    torch.manual_seed(0)
    params = [
        SamplingParams(temperature=1.0, top_k=5) if i % 2 else SamplingParams(temperature=0.0)
        for i in range(n)
    ]
    sampled = _sample(params, torch.tensor([LOGITS] * n))
    assert (sampled[0::2] == 0).all()
    counts = np.bincount(sampled[1::2].numpy(), minlength=V)
    assert counts[5:].sum() == 0
    p = np.exp(np.array(LOGITS[:5]))
    p /= p.sum()
    assert 0.5 * np.abs(counts[:5] / (n // 2) - p).sum() < 0.02
