"""The poolers on hand-made hidden states."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.pooler import ClassifierPooler, EmbeddingPooler, pool_sequences
from pagedllm.pooling_params import PoolingParams


def test_pool_sequences() -> None:
    hidden = torch.randn(9, 4)
    bounds = [0, 2, 7, 9]
    torch.testing.assert_close(pool_sequences(hidden, bounds, "CLS"), hidden[[0, 2, 7]])
    torch.testing.assert_close(pool_sequences(hidden, bounds, "LAST"), hidden[[1, 6, 8]])
    mean = torch.stack([hidden[0:2].mean(0), hidden[2:7].mean(0), hidden[7:9].mean(0)])
    torch.testing.assert_close(pool_sequences(hidden, bounds, "MEAN"), mean)
    with pytest.raises(ValueError, match="pooling_type='MAX'"):
        pool_sequences(hidden, bounds, "MAX")


def test_embedding_pooler_per_request_dimensions_and_normalize() -> None:
    hidden = torch.randn(5, 8)
    pooler = EmbeddingPooler("LAST", normalize=True, dimensions=None)
    out = pooler(
        hidden, [0, 2, 5], [PoolingParams(), PoolingParams(dimensions=3), PoolingParams(normalize=False)][:2]
    )
    torch.testing.assert_close(torch.tensor(out[0]), F.normalize(hidden[1], dim=0))
    torch.testing.assert_close(torch.tensor(out[1]), F.normalize(hidden[4, :3], dim=0))
    raw = pooler(hidden, [0, 5], [PoolingParams(normalize=False)])
    torch.testing.assert_close(torch.tensor(raw[0]), hidden[4])


def test_classifier_pooler_activation() -> None:
    hidden = torch.randn(4, 6)
    head = torch.nn.Linear(6, 1)
    pooler = ClassifierPooler("CLS", head, use_activation=True)
    with torch.no_grad():
        logits = head(hidden[[0, 3]])
        out = pooler(
            hidden,
            [0, 3, 4],
            [PoolingParams(task="score"), PoolingParams(task="score", use_activation=False)],
        )
    torch.testing.assert_close(torch.tensor(out[0]), torch.sigmoid(logits[0]))
    torch.testing.assert_close(torch.tensor(out[1]), logits[1])
