"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat endpoint.

A request becomes a chat completion: ``instructions`` the system message, the conversation of
``previous_response_id`` (kept in a bounded in-memory store) followed by ``input`` the messages, function
tools the chat's tools. The chat's answer becomes output items (reasoning, message, function calls); a
stream becomes OpenAI's typed events (`streaming_responses.ResponseEventWriter`).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from pydantic import ValidationError

from pagedllm.entrypoints.openai.errors import OpenAIError, validation_error
from pagedllm.entrypoints.openai.protocol import UsageInfo, random_id
from pagedllm.entrypoints.openai.protocol_chat import ChatCompletionRequest, ChatCompletionResponse
from pagedllm.entrypoints.openai.protocol_responses import (
    ResponsesRequest,
    function_call_item,
    message_item,
    reasoning_item,
    response_object,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.streaming_responses import ResponseEventWriter

# Responses kept for previous_response_id and GET (least recently stored first out): a bound on the
# memory that stored conversations can take.
MAX_STORED_RESPONSES = 1024
# The chat request's fields, as the Responses API names them (for the errors' param).
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}


@dataclass
class StoredResponse:
    response: dict[str, Any]
    # The conversation up to and including this response's output, as chat messages (no instructions).
    conversation: list[dict[str, Any]]


class ResponseStore:
    """The last MAX_STORED_RESPONSES stored responses, by id."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        self._items[stored.response["id"]] = stored
        self._items.move_to_end(stored.response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        stored = self._items.get(response_id)
        if stored is None:
            raise OpenAIError(
                f"Response with id '{response_id}' not found.", HTTPStatus.NOT_FOUND, param=param
            )
        return stored


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Responses API's input as chat messages (400 naming input for an item it cannot take)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), index)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            # Calls made in one turn are one assistant message, as the chat templates expect them.
            if (
                last is not None
                and last["role"] == "assistant"
                and last.get("tool_calls")
                and not last["content"]
            ):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind != "reasoning":  # earlier reasoning is not shown to the model again
            raise OpenAIError(
                f"input[{index}] has type {kind!r}, which this server does not take", param="input"
            )
    return messages


def _text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise OpenAIError(
                f"input[{index}].content: only text parts are supported, got {kind!r}", param="input"
            )
        texts.append(part.get("text", ""))
    return "\n".join(texts)


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise OpenAIError(
                "tool_choice must name a function: {'type': 'function', 'name': ...}", param="tool_choice"
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    return {"type": fmt.get("type")}


def output_items(response: ChatCompletionResponse) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The chat answer's first choice as output items, and as the assistant message to remember."""
    message = response.choices[0].message
    items: list[dict[str, Any]] = []
    if message.reasoning:
        items.append(reasoning_item(message.reasoning))
    if message.content:
        items.append(message_item(message.content))
    for call in message.tool_calls:
        items.append(function_call_item(call.function.name, call.function.arguments, call.id))
    remembered = {
        "role": "assistant",
        "content": message.content or "",
        **({"tool_calls": [call.model_dump() for call in message.tool_calls]} if message.tool_calls else {}),
    }
    return items, remembered


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self.store.get(response_id).response

    def _conversation(self, request: ResponsesRequest) -> list[dict[str, Any]]:
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            history = list(self.store.get(request.previous_response_id, "previous_response_id").conversation)
        return [*history, *input_messages(request.input)]

    def _chat_request(
        self, request: ResponsesRequest, conversation: list[dict[str, Any]]
    ) -> ChatCompletionRequest:
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        body: dict[str, Any] = {
            "model": request.model,
            "messages": [*system, *conversation],
            "max_completion_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "stream": request.stream,
            "user": request.user,
            "response_format": _response_format(request.text),
        }
        if request.tools:
            body["tools"] = [
                {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                for tool in request.tools
            ]
            body["tool_choice"] = _tool_choice(request.tool_choice)
            body["parallel_tool_calls"] = request.parallel_tool_calls
        if request.stream:
            body["stream_options"] = {"include_usage": True}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            raise _renamed(validation_error(e)) from e

    async def create(
        self, request: ResponsesRequest, trace_headers: dict[str, str] | None = None
    ) -> dict[str, Any] | AsyncIterator[str]:
        refused = request.refused_field()
        if refused is not None:
            raise OpenAIError(f"{refused} is not supported by this server", param=refused)
        conversation = self._conversation(request)
        chat_request = self._chat_request(request, conversation)
        try:
            answer = await self.chat.create(chat_request, trace_headers)
        except OpenAIError as e:
            raise _renamed(e) from e
        response_id = random_id("resp")
        if isinstance(answer, ChatCompletionResponse):
            items, remembered = output_items(answer)
            incomplete = answer.choices[0].finish_reason == "length"
            response = response_object(
                request,
                response_id,
                answer.model,
                items,
                "incomplete" if incomplete else "completed",
                answer.usage,
                "max_output_tokens" if incomplete else None,
            )
            self._remember(request, response, conversation, remembered)
            return response
        return self._events(request, response_id, conversation, answer)

    async def _events(
        self,
        request: ResponsesRequest,
        response_id: str,
        conversation: list[dict[str, Any]],
        chunks: AsyncIterator[str],
    ) -> AsyncIterator[str]:
        model = self.chat.models.check_model(request.model)
        writer = ResponseEventWriter()
        yield writer.event(
            "response.created", response=response_object(request, response_id, model, [], "in_progress")
        )
        yield writer.event(
            "response.in_progress", response=response_object(request, response_id, model, [], "in_progress")
        )
        usage = UsageInfo()
        finish_reason = None
        try:
            async for line in chunks:
                data = line.removeprefix("data: ").strip()
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    param = error.get("param")
                    yield writer.event(
                        "error",
                        code=error.get("code"),
                        message=error.get("message"),
                        param=_PARAMS.get(param, param),
                    )
                    return
                if chunk.get("usage"):
                    usage = UsageInfo.model_validate(chunk["usage"])
                for choice in chunk.get("choices", []):
                    for event in writer.delta(choice.get("delta") or {}):
                        yield event
                    finish_reason = choice.get("finish_reason") or finish_reason
        finally:
            # A client that leaves ends the chat stream (and so its engine request) now.
            await chunks.aclose()  # type: ignore[attr-defined]
        for event in writer.close():
            yield event
        incomplete = finish_reason == "length"
        response = response_object(
            request,
            response_id,
            model,
            writer.items,
            "incomplete" if incomplete else "completed",
            usage,
            "max_output_tokens" if incomplete else None,
        )
        self._remember(request, response, conversation, writer.assistant_message())
        # vLLM ends every stream with response.completed (the status inside says whether it is complete),
        # which the SDKs' stream helpers wait for.
        yield writer.event("response.completed", response=response)

    def _remember(
        self,
        request: ResponsesRequest,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        answer: dict[str, Any],
    ) -> None:
        if request.store:
            self.store.put(StoredResponse(response, [*conversation, answer]))


def _renamed(error: OpenAIError) -> OpenAIError:
    error.param = _PARAMS.get(error.param or "", error.param)
    return error
