"""Pydantic models of the OpenAI API requests and responses the server implements (with vLLM's extras)."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from pagedllm.errors import RequestError
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, clamp_logit_bias
from pagedllm.structured_output.params import StructuredOutputsParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def make_tool_call_id() -> str:
    return random_id("chatcmpl-tool")


# Token ids in requests: JSON integers only. Pydantic's lax mode would take `true` as 1 and "7" as 7,
# which no OpenAI-compatible server accepts.
TokenId = StrictInt


# A lone UTF-16 surrogate ("\ud800" in JSON) parses into a Python str that no UTF-8 codec, tokenizer or
# JSON response can take.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_no_surrogates(value: Any) -> None:
    if isinstance(value, str):
        if _SURROGATE.search(value):
            raise ValueError("contains a lone UTF-16 surrogate (not valid Unicode text)")
    elif isinstance(value, list):
        for item in value:
            _check_no_surrogates(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_no_surrogates(key)
            _check_no_surrogates(item)


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored, as OpenAI's and vLLM's servers do (the server logs them); fields vLLM
    # knows but pagedllm does not implement are refused instead (`UNSUPPORTED_FIELDS`).
    model_config = ConfigDict(extra="allow")

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        # Nested models (chat messages, content parts) check their own fields.
        _check_no_surrogates(value)
        return value

    def ignored_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


# ------------------------------------------------------------------------------------------ errors
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ------------------------------------------------------------------------------------------ shared
class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    # vLLM's extra: usage on every chunk.
    continuous_usage_stats: bool = False


class PromptTokenUsageInfo(OpenAIBaseModel):
    # Prompt tokens served from the prefix cache (--enable-prompt-tokens-details).
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


# Fields vLLM's server takes that pagedllm does not implement yet, each with the values that ask for
# nothing (clients often send the default explicitly). Any other value is refused with a 400 naming the
# field: answering as if it were absent (e.g. unconstrained text for guided_json) would be silently wrong.
_NOT_SET: tuple[Any, ...] = (None,)
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    # The backend is the server's choice (--structured-outputs-config.backend), not a request's.
    "guided_decoding_backend": _NOT_SET,
    "structural_tag": _NOT_SET,
    "logits_processors": (None, []),
    "logprob_token_ids": _NOT_SET,
    "cache_salt": _NOT_SET,
    "session_id": _NOT_SET,
    "ec_transfer_params": _NOT_SET,
    "repetition_detection": _NOT_SET,
    "thinking_token_budget": (None, -1),
    # The server's --stream-interval applies; a request may only ask for what it already gets.
    "stream_interval": (None, 1),
    "routed_experts_prompt_start": (None, 0),
    "return_prompt_text": (None, False),
    "media_io_kwargs": (None, {}),
    "prompt_embeds": _NOT_SET,
    "mm_processor_kwargs": (None, {}),
    "return_token_ids": (None, False),
    "kv_transfer_params": _NOT_SET,
    "vllm_xargs": _NOT_SET,
    # Chat only (in a completion request they are unknown fields all the same).
    "documents": (None, []),
    "reasoning_effort": _NOT_SET,
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": _NOT_SET,
    "modalities": (None, ["text"]),
    "prediction": _NOT_SET,
}


class SamplingFields(OpenAIBaseModel):
    """Sampling fields shared by completions and chat: OpenAI's and vLLM's extra ones."""

    model: str | None = None
    # None: the model's generation config (or the engine default) decides.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    # A JSON boolean: pydantic's lax mode would read "yes", "off" or 1 as one.
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    priority: int = 0
    # {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}.
    response_format: dict[str, Any] | None = None
    # vLLM's structured outputs (StructuredOutputsParams as a dict), and its older guided_* fields.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM's per-request watermark switch (None: the engine's watermark_config decides).
    watermarking: bool | None = None
    # vLLM's beam search: n beams, scored by cumulative logprob over length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: the prompt cut to its last (left) or first (right) N tokens; -1: to max_model_len.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: logprob tokens as "token_id:<id>" (None: the server's --return-tokens-as-token-ids).
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the id the response carries (`cmpl-<request_id>`, `chatcmpl-<request_id>`); random if unset.
    request_id: str | None = None

    def unsupported_fields(self, table: dict[str, tuple[Any, ...]] = UNSUPPORTED_FIELDS) -> list[str]:
        """The vLLM fields given with a value that asks for something pagedllm does not do."""
        given = self.model_extra or {}
        return [name for name, neutral in table.items() if name in given and given[name] not in neutral]

    def constraint_param(self) -> str | None:
        """The request field that carries the output constraint (the one its errors are about)."""
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            return "response_format"
        if self.structured_outputs is not None:
            return "structured_outputs"
        names = (*_GUIDED_FIELDS, "guided_whitespace_pattern")
        return next((name for name in names if getattr(self, name) is not None), None)

    def _structured_outputs_params(self) -> StructuredOutputsParams | None:
        """response_format, structured_outputs or the guided_* fields as one constraint. ValueError
        (naming the field) for a malformed one, or for more than one way of asking at once."""
        guided = {name: getattr(self, name) for name in _GUIDED_FIELDS if getattr(self, name) is not None}
        if self.guided_whitespace_pattern is not None and not guided:
            guided["guided_whitespace_pattern"] = self.guided_whitespace_pattern
        others = (["structured_outputs"] if self.structured_outputs is not None else []) + list(guided)
        from_format = _from_response_format(self.response_format)
        if from_format is not None and others:
            raise RequestError(
                "response_format", f"response_format cannot be combined with {others[0]}: give one constraint"
            )
        if from_format is not None:
            return from_format
        if self.structured_outputs is not None and guided:
            raise RequestError(
                "structured_outputs", f"structured_outputs cannot be combined with {next(iter(guided))}"
            )
        if self.structured_outputs is not None:
            fields: dict[str, Any] = dict(self.structured_outputs)
        elif guided:
            fields = {name.removeprefix("guided_"): value for name, value in guided.items()}
            if self.guided_whitespace_pattern is not None:
                fields["whitespace_pattern"] = self.guided_whitespace_pattern
            if len(fields) - ("whitespace_pattern" in fields) > 1:
                raise RequestError(next(iter(guided)), f"only one of {', '.join(guided)} may be given")
        else:
            return None
        if "resolved_backend" in fields:
            raise RequestError(
                "structured_outputs",
                "structured_outputs.resolved_backend is set by the server, not by requests",
            )
        try:
            return StructuredOutputsParams(**fields)
        except TypeError as e:
            raise RequestError("structured_outputs", f"structured_outputs: {e}") from e

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            logit_bias=clamp_logit_bias(self.logit_bias),  # string keys are converted
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=self._structured_outputs_params(),
            watermarking=self.watermarking,
        )


_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _from_response_format(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError(
                "response_format",
                "response_format of type 'json_schema' needs json_schema.schema, a JSON schema object",
            )
        return StructuredOutputsParams(json=schema)
    raise RequestError(
        "response_format",
        f"response_format of type {kind!r} is not supported (use 'text', 'json_object' or 'json_schema')",
    )


# ------------------------------------------------------------------------------------- completions
class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True

    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt alone (with its logprobs), as vLLM gives it
        to lm-evaluation-harness' loglikelihood scoring; the engine still samples one token, unsent."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        # echo with logprobs reports the prompt's tokens too: the engine computes them as prompt logprobs.
        echo_logprobs = self.logprobs if self.echo and self.prompt_logprobs is None else None
        max_tokens = 1 if self.echo_only() else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs, echo_logprobs)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


# vLLM's prompt_logprobs: per prompt token None (the first) or token id -> {logprob, rank, decoded_token}.
PromptLogprobsField = list[dict[int, dict[str, Any]] | None]


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsField | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------------------------------ models
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    # The base model of a LoRA adapter (None for a base model).
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------------------------------------ tokenization
class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    # vLLM's: also each token as the tokenizer spells it (token_strs).
    return_token_strs: bool | None = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
