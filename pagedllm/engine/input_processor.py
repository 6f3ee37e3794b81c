"""Prompt + SamplingParams -> a validated `EngineCoreRequest` (shared by `LLMEngine` and `AsyncLLM`).

Everything that can be wrong with a request is caught here, before the core sees it, with a message
that names the problem and the numbers: an empty prompt, a prompt that leaves no room in the context,
max_tokens beyond the room left, too many logprobs, token ids outside the vocabulary. The processor holds
no engine state and never waits on anything, so the server can call it from its event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NotRequired, Protocol, TypedDict

from pagedllm.core.request import validate_prompt_token_ids
from pagedllm.engine.protocol import EngineCoreRequest
from pagedllm.errors import RequestError
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.structured_output.backends import apply_engine_config
from pagedllm.structured_output.params import StructuredOutputsParams


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's pre-tokenized prompt form; ``prompt`` optionally carries the text for the outputs."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class _ModelConfig(Protocol):
    """The few ModelConfig members the processor reads (a protocol keeps tests free of real configs)."""

    max_model_len: int
    max_logprobs: int

    def get_vocab_size(self) -> int: ...

    def get_hidden_size(self) -> int: ...

    def get_diff_sampling_param(self) -> dict[str, Any]: ...

    @property
    def eos_token_ids(self) -> list[int]: ...


class _StructuredOutputsConfig(Protocol):
    backend: str
    disable_fallback: bool
    disable_any_whitespace: bool
    disable_additional_properties: bool
    max_schema_bytes: int
    max_schema_depth: int
    max_enum_members: int
    max_regex_repetition: int


class InputProcessor:
    def __init__(
        self,
        model_config: _ModelConfig,
        tokenizer: Tokenizer | None,
        structured_outputs_config: _StructuredOutputsConfig | None = None,
        watermark_check: Callable[[SamplingParams], bool] | None = None,
        scheduling_policy: str = "fcfs",
    ) -> None:
        self.tokenizer = tokenizer
        # Under "fcfs" a priority changes nothing: a request that gives one is refused, not misled.
        self.scheduling_policy = scheduling_policy
        # The engine's watermark support check (spec 5.17), resolving each request's `watermarking`.
        self.watermark_check = watermark_check
        self.structured_outputs_config = structured_outputs_config
        self.max_model_len = int(model_config.max_model_len)
        self.max_logprobs = int(model_config.max_logprobs)
        self.vocab_size = int(model_config.get_vocab_size())
        # A pooling model's resolved pooler config (None: a generative model).
        self.pooler_config: dict[str, Any] | None = getattr(model_config, "pooler_config", None)
        self.hidden_size: int = int(model_config.get_hidden_size()) if self.pooler_config is not None else 0
        # Sampling defaults from generation_config.json; extra EOS ids (e.g. Llama 3's <|eot_id|>) ride
        # along so SamplingParams turns them into stop token ids.
        self.generation_config: dict[str, Any] = dict(model_config.get_diff_sampling_param())
        eos_ids = list(model_config.eos_token_ids)
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
        if not eos_ids and isinstance(tokenizer_eos, int):
            eos_ids = [tokenizer_eos]
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        if len(eos_ids) > 1:
            self.generation_config["eos_token_id"] = eos_ids

    def default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams gets: the model's generation defaults."""
        params = SamplingParams()
        params.update_from_generation_config(self.generation_config, self.eos_token_id)
        return params

    def tokenize_prompt(self, prompt: PromptType) -> tuple[list[int], str | None]:
        """The prompt's token ids and text (None for a TokensPrompt without text)."""
        if isinstance(prompt, str):
            return self._encode(prompt), prompt
        if not isinstance(prompt, Mapping):
            raise TypeError(
                "a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}, "
                f"got {type(prompt).__name__}"
            )
        if "prompt_token_ids" in prompt:
            token_ids = prompt["prompt_token_ids"]
            if not isinstance(token_ids, Sequence) or isinstance(token_ids, str):
                raise TypeError("prompt_token_ids must be a list of integers")
            token_ids = list(token_ids)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in token_ids):
                raise TypeError("prompt_token_ids must be a list of integers")
            text = prompt.get("prompt")
            return token_ids, text if isinstance(text, str) else None
        if "prompt" in prompt and isinstance(prompt["prompt"], str):
            return self._encode(prompt["prompt"]), prompt["prompt"]
        raise RequestError(
            "prompt", f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
        )

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(
                "prompt", "text prompts need a tokenizer; pass {'prompt_token_ids': [...]} instead"
            )
        return list(self.tokenizer.encode(text))

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None,
        arrival_time: float | None = None,
        priority: int = 0,
        trace_headers: dict[str, str] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Validate and build the core request; returns it with the prompt text (for the outputs).
        `PoolingParams` make a pooling request (a pooling model only)."""
        if priority != 0 and self.scheduling_policy != "priority":
            raise RequestError(
                "priority",
                f"priority={priority} has no effect: the scheduling policy is {self.scheduling_policy!r} "
                "(start the engine with scheduling_policy='priority', --scheduling-policy priority)",
            )
        prompt_token_ids, prompt_text = self.tokenize_prompt(prompt)
        validate_prompt_token_ids(prompt_token_ids, self.vocab_size)
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is not None:
            sampling = self._prepare_pooling(pooling, len(prompt_token_ids))
        else:
            if self.pooler_config is not None:
                raise ValueError(
                    "this model is a pooling model: it serves "
                    f"{', '.join(self.pooler_config['tasks'])} requests, not text generation"
                )
            sampling = self.prepare_params(params, len(prompt_token_ids))  # type: ignore[arg-type]
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=sampling,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            pooling_params=pooling,
            trace_headers=trace_headers,
            lora_request=lora_request,
        )
        return request, prompt_text

    def _prepare_pooling(self, params: PoolingParams, num_prompt_tokens: int) -> SamplingParams:
        """Check a pooling request; returns the sampling params it travels with (one final output)."""
        if self.pooler_config is None:
            raise ValueError(f"task={params.task!r} needs a pooling model; this model generates text")
        params.verify(self.pooler_config, self.hidden_size, num_prompt_tokens)
        if num_prompt_tokens > self.max_model_len:
            raise RequestError(
                "prompt",
                f"The prompt has {num_prompt_tokens} tokens, more than the maximum model length of "
                f"{self.max_model_len} tokens: shorten the input",
            )
        sampling = SamplingParams(max_tokens=1, detokenize=False)
        sampling.output_kind = RequestOutputKind.FINAL_ONLY
        return sampling

    def prepare_params(self, params: SamplingParams | None, num_prompt_tokens: int) -> SamplingParams:
        """A per-request copy of ``params`` with model defaults, EOS, bad words and max_tokens resolved."""
        if params is None:
            params = self.default_sampling_params()
        else:
            # The caller may reuse one SamplingParams for many prompts: never mutate theirs.
            params = params.clone()
            params.update_from_generation_config(self.generation_config, self.eos_token_id)
        if params.bad_words:
            if self.tokenizer is None:
                raise RequestError("bad_words", "bad_words need a tokenizer to be turned into token ids")
            params.update_from_tokenizer(self.tokenizer)
        params.verify(self.max_logprobs, self.vocab_size)
        self._check_lengths(params, num_prompt_tokens)
        if params.structured_outputs is not None:
            self._prepare_structured_outputs(params.structured_outputs)
        if self.watermark_check is not None:
            params.watermarking = self.watermark_check(params)
        return params

    def check_structured_outputs_enabled(self) -> _StructuredOutputsConfig:
        """The engine's StructuredOutputsConfig; ValueError where structured outputs cannot run."""
        if self.tokenizer is None:
            raise RequestError(
                "structured_outputs", "structured outputs need a tokenizer (skip_tokenizer_init is set)"
            )
        cfg = self.structured_outputs_config
        if cfg is None:
            raise RequestError("structured_outputs", "structured outputs are not enabled on this engine")
        return cfg

    def _prepare_structured_outputs(self, constraint: StructuredOutputsParams) -> None:
        """Apply the engine's defaults, pick the backend and check the schema / regex / grammar now, so
        a bad one is a RequestError for this request and never reaches the core. A constraint whose
        backend is already resolved was checked by the server's `ConstraintChecker`, in a child process."""
        cfg = self.check_structured_outputs_enabled()
        if constraint.resolved_backend is None:
            apply_engine_config(constraint, cfg)

    def _check_lengths(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise RequestError(
                "prompt",
                f"The prompt has {num_prompt_tokens} tokens, but the maximum model length is "
                f"{self.max_model_len} tokens, which leaves no room for any output token: "
                "shorten the prompt or raise max_model_len",
            )
        user_set = params.user_set_fields or frozenset()
        if params.max_tokens is None or (params.max_tokens > room and "max_tokens" not in user_set):
            # None means "up to the context", and a default (16, or the generation config's) that does
            # not fit is cut to the room left: make it explicit so the scheduler and metrics see a number.
            params.max_tokens = room
        elif params.max_tokens > room:
            raise RequestError(
                "max_tokens",
                f"max_tokens={params.max_tokens} is too large: the prompt has {num_prompt_tokens} tokens and "
                f"the maximum model length is {self.max_model_len}, so at most {room} tokens can be generated",
            )
        if params.min_tokens > params.max_tokens:
            raise RequestError(
                "min_tokens", f"min_tokens={params.min_tokens} is more than max_tokens={params.max_tokens}"
            )
