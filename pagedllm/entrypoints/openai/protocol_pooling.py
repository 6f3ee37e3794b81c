"""Request and response models of the pooling endpoints, in OpenAI's and vLLM's shapes:
/v1/embeddings, /pooling, /score (/v1/score) and /rerank (/v1/rerank)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel, TokenId, random_id

# A string, a list of strings, token ids, or a list of token-id lists.
EmbeddingInput = str | list[str] | list[TokenId] | list[list[TokenId]]


class PoolingUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0


class EmbeddingRequest(OpenAIBaseModel):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras.
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = 0


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the model's pooled output for each input (embeddings, or class probabilities)."""


class PoolingData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("pool"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class ScoreRequest(OpenAIBaseModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    priority: int = 0


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankRequest(OpenAIBaseModel):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)
    """How many of the best documents to return (0: all)."""
    priority: int = 0


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]
