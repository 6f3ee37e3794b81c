"""Poolers: the hidden states of each whole prompt -> one output vector per request.

`EmbeddingPooler` pools (CLS / MEAN / LAST), truncates to the request's Matryoshka `dimensions` and
L2-normalises; `ClassifierPooler` pools, runs the model's classification head and its activation
(sigmoid for a single label, as sentence-transformers' CrossEncoder, else softmax). Both return plain
lists (the scheduler's side is torch-free)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from pagedllm.pooling_params import PoolingParams


@runtime_checkable
class SupportsClassification(Protocol):
    """A model with a classification head over its pooled hidden state (a cross-encoder)."""

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[num_reqs, hidden] -> [num_reqs, num_labels] logits."""
        ...


def pool_sequences(hidden: torch.Tensor, bounds: Sequence[int], pooling_type: str) -> torch.Tensor:
    """[num_reqs, hidden] in float32: each sequence's first token (CLS), last token (LAST) or mean
    (MEAN); `bounds` are the sequences' start offsets in `hidden` followed by the end."""
    starts = torch.tensor(bounds[:-1], dtype=torch.int64, device=hidden.device)
    ends = torch.tensor(bounds[1:], dtype=torch.int64, device=hidden.device)
    if pooling_type == "CLS":
        return hidden.index_select(0, starts).float()
    if pooling_type == "LAST":
        return hidden.index_select(0, ends - 1).float()
    if pooling_type == "MEAN":
        lens = ends - starts
        segment = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens)
        sums = torch.zeros(len(lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, segment, hidden.float())
        return sums / lens[:, None].to(torch.float32)
    raise ValueError(f"pooling_type={pooling_type!r} is not supported (CLS, MEAN, LAST)")


class EmbeddingPooler:
    def __init__(self, pooling_type: str, normalize: bool, dimensions: int | None) -> None:
        self.pooling_type = pooling_type
        self.normalize = normalize
        self.dimensions = dimensions

    def __call__(
        self, hidden: torch.Tensor, bounds: Sequence[int], params: Sequence[PoolingParams]
    ) -> list[list[float]]:
        pooled = pool_sequences(hidden, bounds, self.pooling_type)
        out: list[list[float]] = []
        for row, p in zip(pooled, params):
            dims = p.dimensions if p.dimensions is not None else self.dimensions
            vector = row[:dims] if dims is not None else row
            # Matryoshka: truncate first, then normalise what is kept.
            if self.normalize if p.normalize is None else p.normalize:
                vector = F.normalize(vector, dim=0)
            out.append(vector.tolist())
        return out


class ClassifierPooler:
    def __init__(
        self, pooling_type: str, head: Callable[[torch.Tensor], torch.Tensor], use_activation: bool
    ) -> None:
        self.pooling_type = pooling_type
        self.head = head
        self.use_activation = use_activation

    def __call__(
        self, hidden: torch.Tensor, bounds: Sequence[int], params: Sequence[PoolingParams]
    ) -> list[list[float]]:
        pooled = pool_sequences(hidden, bounds, self.pooling_type).to(hidden.dtype)
        logits = self.head(pooled).float()
        activated = torch.sigmoid(logits) if logits.shape[1] == 1 else torch.softmax(logits, dim=-1)
        out = []
        for i, p in enumerate(params):
            use = self.use_activation if p.use_activation is None else p.use_activation
            out.append((activated[i] if use else logits[i]).tolist())
        return out


Pooler = EmbeddingPooler | ClassifierPooler


def build_pooler(model: Any, pooler_config: Mapping[str, Any]) -> Pooler:
    """The pooler of a loaded pooling model: its classification head where it has one."""
    if isinstance(model, SupportsClassification):
        return ClassifierPooler(
            pooler_config["pooling_type"], model.classify, pooler_config["use_activation"]
        )
    return EmbeddingPooler(
        pooler_config["pooling_type"], pooler_config["normalize"], pooler_config["dimensions"]
    )
