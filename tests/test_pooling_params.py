"""PoolingParams validation against a model's resolved pooler config."""

from __future__ import annotations

import pytest

from pagedllm.pooling_params import PoolingParams

EMBED = {"tasks": ("embed",), "matryoshka_dimensions": None}


def test_dimensions_bounds_and_matryoshka() -> None:
    PoolingParams(dimensions=64).verify(EMBED, 64, 3)
    with pytest.raises(ValueError, match="dimensions=65 must be between 1 and the hidden size 64"):
        PoolingParams(dimensions=65).verify(EMBED, 64, 3)
    with pytest.raises(ValueError, match="dimensions=0"):
        PoolingParams(dimensions=0).verify(EMBED, 64, 3)
    declared = {**EMBED, "matryoshka_dimensions": [16, 32]}
    PoolingParams(dimensions=16).verify(declared, 64, 3)
    with pytest.raises(
        ValueError, match=r"dimensions=24 is not one of the model's matryoshka_dimensions \[16, 32\]"
    ):
        PoolingParams(dimensions=24).verify(declared, 64, 3)


def test_task_and_token_types() -> None:
    with pytest.raises(ValueError, match="task='score' is not supported by this model"):
        PoolingParams(task="score").verify(EMBED, 64, 3)
    scorer = {"tasks": ("classify", "score")}
    with pytest.raises(ValueError, match="dimensions applies to embeddings only"):
        PoolingParams(task="score", dimensions=4).verify(scorer, 64, 3)
    with pytest.raises(ValueError, match="token_type_ids has 2 entries for a prompt of 3 tokens"):
        PoolingParams(task="score", token_type_ids=[0, 1]).verify(scorer, 64, 3)
    PoolingParams(task="score", token_type_ids=[0, 1, 1]).verify(scorer, 64, 3)
