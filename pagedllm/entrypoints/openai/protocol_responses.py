"""The Responses API's request (POST /v1/responses) and the objects of its answer, in OpenAI's shapes:
a `response` object whose output is a list of items (message, function_call, reasoning)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel, UsageInfo, random_id


class ResponseFunctionTool(OpenAIBaseModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    # A user message, or a list of items: messages ({"role", "content"}), earlier function calls and
    # their outputs.
    input: str | list[dict[str, Any]]
    # The system message of this request (a previous response's instructions are not carried over).
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    # Keep the response for GET /v1/responses/{id} and previous_response_id.
    store: bool = True
    metadata: dict[str, str] | None = None
    # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    text: dict[str, Any] | None = None
    user: str | None = None
    # OpenAI's features that would have no effect here: refused unless neutral.
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    prompt: dict[str, Any] | None = None

    def refused_field(self) -> str | None:
        """The first field given with a value this server cannot honour."""
        neutral = {
            "background": (None, False),
            "truncation": (None, "disabled"),
            "reasoning": (None, {}),
            "include": (None, []),
            "top_logprobs": (None, 0),
            "prompt": (None,),
        }
        return next((name for name, values in neutral.items() if getattr(self, name) not in values), None)


def usage_object(usage: UsageInfo) -> dict[str, Any]:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached or 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def response_object(
    request: ResponsesRequest,
    response_id: str,
    model: str,
    output: list[dict[str, Any]],
    status: str,
    usage: UsageInfo | None = None,
    incomplete_reason: str | None = None,
) -> dict[str, Any]:
    """OpenAI's `response` object (status: in_progress, completed or incomplete)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": output,
        "usage": None if usage is None else usage_object(usage),
        "error": None,
        "incomplete_details": None if incomplete_reason is None else {"reason": incomplete_reason},
        "instructions": request.instructions,
        "previous_response_id": request.previous_response_id,
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
        "tool_choice": request.tool_choice,
        "parallel_tool_calls": request.parallel_tool_calls,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {},
        "text": request.text or {"format": {"type": "text"}},
        "truncation": request.truncation or "disabled",
        "store": request.store,
        "user": request.user,
    }


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id or random_id("msg"),
        "role": "assistant",
        "status": status,
        "content": [output_text_part(text)] if status == "completed" else [],
    }


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(
    name: str, arguments: str, call_id: str, status: str = "completed", item_id: str | None = None
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or random_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id or random_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }
