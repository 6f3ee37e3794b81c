"""POST /v1/embeddings, /pooling, /score and /rerank over a pooling model.

Each input becomes one pooling request of the engine (batched by the scheduler with the others); the
handler waits for every one's final output. Scores are a cross-encoder's output for the text pair, or
for an embedding model the cosine similarity of the two texts' embeddings (as vLLM)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
from fastapi import FastAPI, Request

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.input_processor import TokensPrompt
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel, random_id
from pagedllm.entrypoints.openai.protocol_pooling import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagedllm.entrypoints.openai.request_limits import RequestLimits
from pagedllm.entrypoints.openai.serving_invocations import Invocation
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_utils import (
    PromptTokenizer,
    engine_dead_error,
    request_error,
)
from pagedllm.llm_pooling import cosine_similarity, cross_encoder_prompt, pair_texts
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams

# vLLM fields of the pooling requests that pagedllm does not implement: refused, never ignored.
UNSUPPORTED_POOLING_FIELDS = ("truncate_prompt_tokens", "embed_dtype", "endianness")


def check_pooling_fields(request: OpenAIBaseModel) -> None:
    for name in UNSUPPORTED_POOLING_FIELDS:
        if name in (request.model_extra or {}):
            raise OpenAIError(f"{name} is not supported yet", param=name)


def encode_vector(values: Sequence[float], encoding_format: str) -> list[float] | str:
    """OpenAI's `base64`: the float32 little-endian bytes, base64-encoded."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return list(values)


class OpenAIServingPooling:
    def __init__(
        self, engine: AsyncLLM, models: OpenAIServingModels, prompts: PromptTokenizer, limits: RequestLimits
    ) -> None:
        self.engine = engine
        self.models = models
        self.prompts = prompts
        self.limits = limits
        config = engine.model_config.pooler_config
        self.tasks: tuple[str, ...] = tuple(config["tasks"]) if config is not None else ()

    # ------------------------------------------------------------------------------------ inputs
    async def _input_prompts(self, request: EmbeddingRequest) -> list[TokensPrompt]:
        value = request.input
        # One list of token ids is one input (bounded by the context); any other list holds inputs.
        if isinstance(value, list) and value and not isinstance(value[0], int):
            self.limits.check_count("input", value)
        if isinstance(value, str):
            texts: list[str] | None = [value]
        elif value and all(isinstance(v, str) for v in value):
            texts = list(value)  # type: ignore[arg-type]
        else:
            texts = None
        if texts is not None:
            ids = [await self.prompts.encode(t, request.add_special_tokens, "input") for t in texts]
        elif value and all(isinstance(v, int) for v in value):
            ids = [list(value)]  # type: ignore[arg-type]
        elif value and all(isinstance(v, list) for v in value):
            ids = [list(v) for v in value]  # type: ignore[union-attr]
        else:
            raise OpenAIError(
                "input must be a non-empty string, list of strings or list of token ids", param="input"
            )
        return [TokensPrompt(prompt_token_ids=t) for t in ids]

    async def _run(
        self, prompts: list[TokensPrompt], params: list[PoolingParams], priority: int
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt; a bad one fails the whole request with a 400 naming the field."""
        request_id = random_id("pool")
        streams = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                streams.append(
                    await self.engine.add_request(f"{request_id}-{i}", prompt, p, priority=priority)
                )
        except ValueError as e:
            for stream in streams:
                stream.abort()
            raise request_error(e, "input") from e
        except EngineDeadError as e:
            for stream in streams:
                stream.abort()
            raise engine_dead_error(e) from e

        async def final(stream: Any) -> PoolingRequestOutput:
            # A pooling request has exactly one (final) output.
            outputs = [output async for output in stream]
            return outputs[-1]

        try:
            return list(await asyncio.gather(*(final(s) for s in streams)))
        except EngineDeadError as e:
            raise engine_dead_error(e) from e
        finally:
            for stream in streams:
                stream.abort()

    def _require(self, task: str, api: str) -> None:
        if task not in self.tasks:
            raise OpenAIError(f"The model does not support the {api} (it supports: {', '.join(self.tasks)})")

    @staticmethod
    def _usage(outputs: Sequence[PoolingRequestOutput]) -> PoolingUsage:
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)

    # ------------------------------------------------------------------------------------ handlers
    async def embeddings(self, request: EmbeddingRequest) -> EmbeddingResponse:
        model = self.models.check_model(request.model)
        check_pooling_fields(request)
        self._require("embed", "Embeddings API")
        prompts = await self._input_prompts(request)
        params = PoolingParams(task="embed", dimensions=request.dimensions, normalize=request.normalize)
        outputs = await self._run(prompts, [params] * len(prompts), request.priority)
        data = [
            EmbeddingData(index=i, embedding=encode_vector(o.outputs.data, request.encoding_format))
            for i, o in enumerate(outputs)
        ]
        return EmbeddingResponse(model=model, data=data, usage=self._usage(outputs))

    async def pooling(self, request: PoolingRequest) -> PoolingResponse:
        model = self.models.check_model(request.model)
        check_pooling_fields(request)
        task = self.tasks[0]
        dims = request.dimensions if task == "embed" else None
        if request.dimensions is not None and dims is None:
            raise OpenAIError("dimensions applies to embedding models only", param="dimensions")
        prompts = await self._input_prompts(request)
        params = PoolingParams(task=task, dimensions=dims, normalize=request.normalize)  # type: ignore[arg-type]
        outputs = await self._run(prompts, [params] * len(prompts), request.priority)
        data = [
            PoolingData(index=i, data=encode_vector(o.outputs.data, request.encoding_format))
            for i, o in enumerate(outputs)
        ]
        return PoolingResponse(model=model, data=data, usage=self._usage(outputs))

    async def _scores(self, pairs: list[tuple[str, str]], priority: int) -> tuple[list[float], int]:
        """Each pair's score and the prompt tokens pooled."""
        if "score" in self.tasks:
            prompts, params = [], []
            for a, b in pairs:
                prompt, token_types = await asyncio.to_thread(
                    cross_encoder_prompt, self.engine.tokenizer, a, b
                )
                prompts.append(prompt)
                params.append(PoolingParams(task="score", token_type_ids=token_types))
            outputs = await self._run(prompts, params, priority)
            return [o.outputs.data[0] for o in outputs], self._usage(outputs).total_tokens
        self._require("embed", "Score API")
        texts = [t for pair in pairs for t in pair]
        prompts = [TokensPrompt(prompt_token_ids=await self.prompts.encode(t, True, "input")) for t in texts]
        outputs = await self._run(prompts, [PoolingParams(task="embed")] * len(prompts), priority)
        scores = [
            cosine_similarity(a.outputs.data, b.outputs.data) for a, b in zip(outputs[::2], outputs[1::2])
        ]
        return scores, self._usage(outputs).total_tokens

    async def score(self, request: ScoreRequest) -> ScoreResponse:
        model = self.models.check_model(request.model)
        check_pooling_fields(request)
        for name in ("text_1", "text_2"):
            texts = getattr(request, name)
            self.limits.check_count(name, texts if isinstance(texts, list) else None, "input")
        try:
            pairs = pair_texts(request.text_1, request.text_2)
        except ValueError as e:
            raise OpenAIError(str(e), param="text_2") from e
        scores, tokens = await self._scores(pairs, request.priority)
        return ScoreResponse(
            model=model,
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )

    async def rerank(self, request: RerankRequest) -> RerankResponse:
        model = self.models.check_model(request.model)
        check_pooling_fields(request)
        if not request.documents:
            raise OpenAIError("documents must not be empty", param="documents")
        self.limits.check_count("documents", request.documents, "input")
        scores, tokens = await self._scores([(request.query, d) for d in request.documents], request.priority)
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        if request.top_n:
            order = order[: request.top_n]
        results = [
            RerankResult(
                index=i, document=RerankDocument(text=request.documents[i]), relevance_score=scores[i]
            )
            for i in order
        ]
        return RerankResponse(model=model, usage=RerankUsage(total_tokens=tokens), results=results)


def add_pooling_routes(
    app: FastAPI, pooling: OpenAIServingPooling, respond: Callable[[Request, Awaitable[Any]], Awaitable[Any]]
) -> list[Invocation]:
    """The pooling model's routes (vLLM's paths, with and without /v1 for score and rerank); returns
    them for /invocations, in vLLM's order."""

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw: Request) -> Any:
        return await respond(raw, pooling.embeddings(request))

    @app.post("/pooling")
    async def create_pooling(request: PoolingRequest, raw: Request) -> Any:
        return await respond(raw, pooling.pooling(request))

    score = _score_route(pooling, respond)
    for path in ("/score", "/v1/score"):
        app.add_api_route(path, score, methods=["POST"])
    rerank = _rerank_route(pooling, respond)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])
    return [(EmbeddingRequest, create_embedding), (ScoreRequest, score), (RerankRequest, rerank)]


def _score_route(pooling: OpenAIServingPooling, respond: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    async def create_score(request: ScoreRequest, raw: Request) -> Any:
        return await respond(raw, pooling.score(request))

    return create_score


def _rerank_route(
    pooling: OpenAIServingPooling, respond: Callable[..., Awaitable[Any]]
) -> Callable[..., Any]:
    async def do_rerank(request: RerankRequest, raw: Request) -> Any:
        return await respond(raw, pooling.rerank(request))

    return do_rerank
