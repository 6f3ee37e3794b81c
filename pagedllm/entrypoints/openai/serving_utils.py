"""Helpers shared by the completion and chat handlers: starting requests, merging streams, SSE lines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel

from pagedllm.engine.async_llm import AsyncLLM, RequestStream
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.input_processor import PromptType
from pagedllm.entrypoints.openai.errors import OpenAIError, guess_param
from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, SamplingFields
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


def engine_dead_error(e: EngineDeadError) -> OpenAIError:
    return OpenAIError(str(e), status=HTTPStatus.SERVICE_UNAVAILABLE, err_type="EngineDeadError")


def check_stream_options(request: SamplingFields) -> None:
    """stream_options only means something for a stream; OpenAI refuses it otherwise, and so do we."""
    if request.stream_options is not None and not request.stream:
        raise OpenAIError("stream_options can only be given when stream is true", param="stream_options")


def param_of_engine_error(message: str, param_names: list[str], prompt_param: str) -> str | None:
    """The request field an InputProcessor/SamplingParams error is about."""
    lowered = message.lower()
    # Prompt errors ("The prompt has 600 tokens, but the maximum model length ...") name the model in
    # passing; they are about the prompt (or, for chat, the messages).
    if lowered.startswith("the prompt") or "prompt_token_ids" in lowered or "prompt must" in lowered:
        return prompt_param
    return guess_param(message, [p for p in param_names if p not in ("model", "prompt", "messages")])


async def start_requests(
    engine: AsyncLLM,
    request_id: str,
    prompts: list[PromptType],
    params: SamplingParams,
    priority: int,
    param_names: list[str],
    prompt_param: str,
) -> list[RequestStream]:
    """Admit one engine request per prompt; a bad one fails them all with a 400 naming the parameter."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await engine.add_request(sub_id, prompt, params, priority=priority))
    except (ValueError, TypeError) as e:
        for stream in streams:
            stream.abort()
        message = str(e)
        raise OpenAIError(message, param=param_of_engine_error(message, param_names, prompt_param)) from e
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
