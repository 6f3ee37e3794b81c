"""Helpers shared by the completion and chat handlers: starting requests, merging streams, SSE lines."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel

from pagedllm.engine.async_llm import AsyncLLM, RequestStream
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.input_processor import PromptType
from pagedllm.entrypoints.openai.cli_args import FrontendOptions
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    UNSUPPORTED_FIELDS,
    ErrorInfo,
    ErrorResponse,
    PromptTokenUsageInfo,
    SamplingFields,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.request_limits import RequestLimits
from pagedllm.entrypoints.openai.serving_logprobs import LogprobFormatter
from pagedllm.errors import RequestError
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


def engine_dead_error(e: EngineDeadError) -> OpenAIError:
    return OpenAIError(str(e), status=HTTPStatus.SERVICE_UNAVAILABLE, err_type="EngineDeadError")


def usage_info(
    options: FrontendOptions, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
) -> UsageInfo:
    """Token counts; with --enable-prompt-tokens-details, the prompt's tokens found in the prefix cache
    (reported when there are any, as vLLM does)."""
    usage = UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
    if options.enable_prompt_tokens_details and cached_tokens:
        usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached_tokens)
    return usage


def logprob_formatter(tokenizer: Any, options: FrontendOptions, request: SamplingFields) -> LogprobFormatter:
    """The request's return_tokens_as_token_ids, else the server's."""
    as_ids = request.return_tokens_as_token_ids
    return LogprobFormatter(tokenizer, options.return_tokens_as_token_ids if as_ids is None else as_ids)


def includes_usage(options: FrontendOptions, request: SamplingFields) -> tuple[bool, bool]:
    """Whether a stream ends with a usage chunk, and whether every chunk carries usage
    (stream_options, or --enable-force-include-usage)."""
    stream_options = request.stream_options
    include = options.enable_force_include_usage or (
        stream_options is not None and stream_options.include_usage
    )
    return include, include and stream_options is not None and stream_options.continuous_usage_stats


def check_prompt_logprobs(request: SamplingFields) -> None:
    """vLLM sends prompt_logprobs in full responses only."""
    if request.stream and request.prompt_logprobs is not None:
        raise OpenAIError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")


def check_stream_options(request: SamplingFields) -> None:
    """stream_options only means something for a stream; OpenAI refuses it otherwise, and so do we."""
    if request.stream_options is not None and not request.stream:
        raise OpenAIError("stream_options can only be given when stream is true", param="stream_options")


class PromptTokenizer:
    """Tokenizes prompt text in a worker thread, so that a huge prompt cannot stall the event loop (and
    with it /health and every other request); text too long to fit the context is refused before that."""

    # Normalizers may fold a few characters into one (NFKC on combining marks): a generous factor keeps the
    # bound below any real prompt's token count.
    _NORMALIZATION_SLACK = 4

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # No token stands for more characters than its longest vocabulary entry, so a text longer than
        # this has more than max_model_len tokens whatever it holds.
        longest = max((len(piece) for piece in tokenizer.get_vocab()), default=1)
        self.max_chars = (max_model_len + 1) * longest * self._NORMALIZATION_SLACK

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if len(text) > self.max_chars:
            raise OpenAIError(
                f"The prompt has {len(text)} characters, more than the {self.max_chars} that could fit in "
                f"the maximum model length of {self.max_model_len} tokens",
                param=param,
            )
        ids = await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return list(ids)


def response_id(prefix: str, request: SamplingFields) -> tuple[str, str]:
    """The response's id (vLLM's ``<prefix>-<request_id>`` when the client gave one) and the engine's id
    for the request: the client's id made unique, so two requests that reuse one never collide."""
    if request.request_id is None:
        rid = random_id(prefix)
        return rid, rid
    rid = f"{prefix}-{request.request_id}"
    return rid, f"{rid}-{uuid.uuid4().hex[:8]}"


def truncate_prompt(token_ids: list[int], request: SamplingFields, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the prompt's last N tokens (its first N with truncation_side
    "right"); -1 means max_model_len."""
    keep = request.truncate_prompt_tokens
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise OpenAIError(
            f"truncate_prompt_tokens={keep} is more than the maximum model length of {max_model_len}",
            param="truncate_prompt_tokens",
        )
    if len(token_ids) <= keep:
        return token_ids
    return token_ids[:keep] if request.truncation_side == "right" else token_ids[len(token_ids) - keep :]


def check_supported_fields(
    request: SamplingFields, limits: RequestLimits, table: dict[str, tuple[Any, ...]] = UNSUPPORTED_FIELDS
) -> None:
    """400 for a vLLM field pagedllm does not implement, for ``n`` above the server's cap and for a
    sampling field over its size limit."""
    unsupported = request.unsupported_fields(table)
    if unsupported:
        name = unsupported[0]
        raise OpenAIError(f"{name} is not supported yet", param=name)
    # Each choice is a sequence in the engine: one request must not be able to fill the batch alone.
    if request.n > limits.n:
        raise OpenAIError(f"n={request.n} is more than this server's --max-n-sequences={limits.n}", param="n")
    limits.check_sampling(request)


def request_error(error: ValueError, prompt_param: str, constraint_param: str | None = None) -> OpenAIError:
    """A 400 for a request the engine refused, naming the field its RequestError names. Validators name
    the offline API's fields, which are the request's too, except two the request spells its own way: the
    prompt (``prompt_param``: chat's messages, pooling's input) and the output constraint (the field it
    came from, ``constraint_param``: response_format, guided_json, tools, ...)."""
    param = error.param if isinstance(error, RequestError) else None
    if param == "prompt":
        param = prompt_param
    elif param == "structured_outputs" and constraint_param is not None:
        param = constraint_param
    return OpenAIError(str(error), param=param)


async def start_requests(
    engine: AsyncLLM,
    request_id: str,
    prompts: list[PromptType],
    params: SamplingParams,
    priority: int,
    prompt_param: str,
    constraint_param: str | None = None,
    trace_headers: dict[str, str] | None = None,
    lora_request: LoRARequest | None = None,
) -> list[RequestStream]:
    """Admit one engine request per prompt (with the adapter the model name selected); a bad one fails
    them all with a 400 naming the parameter. ``trace_headers`` (the client's W3C trace context) become
    the parent of each request's span."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(
                await engine.add_request(
                    sub_id,
                    prompt,
                    params,
                    priority=priority,
                    trace_headers=trace_headers,
                    lora_request=lora_request,
                )
            )
    except ValueError as e:
        for stream in streams:
            stream.abort()
        raise request_error(e, prompt_param, constraint_param) from e
    except EngineDeadError as e:
        for stream in streams:
            stream.abort()
        raise engine_dead_error(e) from e
    return streams


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's index."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
            await queue.put(None)
        except BaseException as e:  # forwarded to the consumer, including cancellation
            await queue.put(e)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


def sse(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude_unset=False)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def sse_error(error: OpenAIError) -> str:
    body = ErrorResponse(
        error=ErrorInfo(message=error.message, type=error.err_type, param=error.param, code=int(error.status))
    )
    return sse(body)


SSE_DONE = "data: [DONE]\n\n"
