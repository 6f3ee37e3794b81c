"""The offline pooling API of `LLM`: `encode`, `embed`, `classify` and `score` (vLLM's methods).

Every call queues its prompts as pooling requests through the same engine and scheduler as `generate`;
a request finishes once its prompt is computed, with its pooled output."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from pagedllm.engine.input_processor import PromptType, TokensPrompt
from pagedllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams, PoolingTask

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams


def _as_list(prompts: Any) -> list[Any]:
    return [prompts] if isinstance(prompts, str | Mapping) else list(prompts)


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)


def pair_texts(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's score pairing: one text against many (either side), or N against N element-wise."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("text_1 and text_2 must not be empty")
    if len(first) == 1:
        first = first * len(second)
    elif len(second) == 1:
        second = second * len(first)
    elif len(first) != len(second):
        raise ValueError(
            f"text_1 has {len(first)} entries and text_2 {len(second)}: give 1 and N, or N and N"
        )
    return list(zip(first, second))


def cross_encoder_prompt(tokenizer: Any, text_1: str, text_2: str) -> tuple[TokensPrompt, list[int] | None]:
    """The pair as the cross-encoder was trained on it: `[CLS] a [SEP] b [SEP]` with segment ids."""
    if tokenizer is None:
        raise ValueError("scoring text pairs needs a tokenizer (skip_tokenizer_init is set)")
    encoded = tokenizer(text_1, text_2)
    token_types = encoded.get("token_type_ids")
    return TokensPrompt(prompt_token_ids=list(encoded["input_ids"])), (
        list(token_types) if token_types is not None else None
    )


class PoolingMixin:
    """Mixed into `LLM`, which provides the engine and `_run_requests`."""

    llm_engine: LLMEngine

    if TYPE_CHECKING:

        def _run_requests(
            self,
            prompts: Sequence[PromptType],
            params: Sequence[SamplingParams | PoolingParams],
            use_tqdm: bool,
            priority: Sequence[int] | None = None,
        ) -> list[RequestOutput | PoolingRequestOutput]: ...

    def _pooling_tasks(self) -> tuple[str, ...]:
        config = self.llm_engine.model_config.pooler_config
        return tuple(config["tasks"]) if config is not None else ()

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        pooling_task: PoolingTask | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pooled outputs of the prompts (`pooling_task` overrides the params' task)."""
        prompt_list = _as_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} pooling_params for {len(prompt_list)} prompts")
        if pooling_task is not None:
            params_list = [_with_task(p, pooling_task) for p in params_list]
        return self._run_requests(prompt_list, params_list, use_tqdm)  # type: ignore[return-value]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`)."""
        self._require_task("embed")
        outputs = self.encode(prompts, pooling_params, use_tqdm, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def classify(
        self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (`outputs.probs`)."""
        self._require_task("classify")
        outputs = self.encode(prompts, None, use_tqdm, pooling_task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in outputs]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """Scores of text pairs: a cross-encoder's relevance score, or an embedding model's cosine
        similarity of the two embeddings."""
        pairs = pair_texts(text_1, text_2)
        tasks = self._pooling_tasks()
        if "score" in tasks:
            base = pooling_params or PoolingParams()
            tokenizer = self.llm_engine.get_tokenizer()
            prompts, params = [], []
            for a, b in pairs:
                prompt, token_types = cross_encoder_prompt(tokenizer, a, b)
                prompts.append(prompt)
                params.append(_with_task(base, "score", token_types))
            outputs = self._run_requests(prompts, params, use_tqdm)
            return [
                ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.data[0]), o.prompt_token_ids)  # type: ignore[union-attr]
                for o in outputs
            ]
        self._require_task("embed", "score")
        texts = [t for pair in pairs for t in pair]
        embedded = self.embed(texts, pooling_params, use_tqdm)
        return [
            ScoringRequestOutput(
                first.request_id,
                ScoringOutput(cosine_similarity(first.outputs.embedding, second.outputs.embedding)),
                [*first.prompt_token_ids, *second.prompt_token_ids],
            )
            for first, second in zip(embedded[::2], embedded[1::2])
        ]

    def _require_task(self, *accepted: str) -> None:
        tasks = self._pooling_tasks()
        if not any(t in tasks for t in accepted):
            raise ValueError(
                f"this model does not support {accepted[-1]!r}: "
                + (
                    f"it supports {', '.join(tasks)}"
                    if tasks
                    else "it is a generative model (use runner='pooling')"
                )
            )


def _with_task(
    params: PoolingParams, task: PoolingTask, token_type_ids: list[int] | None = None
) -> PoolingParams:
    """A copy for one request: the user's params object may serve many prompts."""
    return msgspec.structs.replace(params, task=task, token_type_ids=token_type_ids or params.token_type_ids)
