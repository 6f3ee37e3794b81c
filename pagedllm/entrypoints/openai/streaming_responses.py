"""A streamed chat answer as the Responses API's events, with OpenAI's names and order: each output item
is announced (`response.output_item.added`), grows by deltas (`response.output_text.delta`,
`response.reasoning_text.delta`, `response.function_call_arguments.delta`) and is closed
(`....done`, `response.output_item.done`) before the next one opens."""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.protocol_responses import (
    function_call_item,
    message_item,
    output_text_part,
    reasoning_item,
)


class ResponseEventWriter:
    """Turns chat deltas into events; `items` holds the output items so far (final once closed)."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        # The text item being written (a message or a reasoning item) and its text so far.
        self._text_item: dict[str, Any] | None = None
        self._text = ""
        # Function calls still open: the chat's tool call index -> the item.
        self._calls: dict[int, dict[str, Any]] = {}

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def _add(self, item: dict[str, Any]) -> str:
        self.items.append(item)
        return self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)

    def delta(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            events += self._write("reasoning", reasoning)
        if delta.get("content"):
            events += self._write("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def _write(self, kind: str, text: str) -> list[str]:
        events: list[str] = []
        if self._text_item is None or self._text_item["type"] != kind:
            events += self._close_text()
            if kind == "message":
                self._text_item = message_item("", status="in_progress")
                events.append(self._add(self._text_item))
                events.append(self._event_of_part("response.content_part.added", output_text_part("")))
            else:
                self._text_item = {**reasoning_item(""), "content": [], "status": "in_progress"}
                events.append(self._add(self._text_item))
        self._text += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self.event(name, **self._where(), content_index=0, delta=text, **extra))
        return events

    def _where(self) -> dict[str, Any]:
        assert self._text_item is not None
        return {"item_id": self._text_item["id"], "output_index": self.items.index(self._text_item)}

    def _event_of_part(self, kind: str, part: dict[str, Any]) -> str:
        return self.event(kind, **self._where(), content_index=0, part=part)

    def _close_text(self) -> list[str]:
        item = self._text_item
        if item is None:
            return []
        events: list[str] = []
        if item["type"] == "message":
            part = output_text_part(self._text)
            events.append(
                self.event(
                    "response.output_text.done",
                    **self._where(),
                    content_index=0,
                    text=self._text,
                    logprobs=[],
                )
            )
            events.append(self._event_of_part("response.content_part.done", part))
            item.update(content=[part], status="completed")
        else:
            events.append(
                self.event("response.reasoning_text.done", **self._where(), content_index=0, text=self._text)
            )
            item.update(content=[{"type": "reasoning_text", "text": self._text}], status="completed")
        events.append(self.event("response.output_item.done", output_index=self.items.index(item), item=item))
        self._text_item, self._text = None, ""
        return events

    def _call(self, call: dict[str, Any]) -> list[str]:
        events: list[str] = []
        index = call.get("index", 0)
        function = call.get("function") or {}
        item = self._calls.get(index)
        if item is None:
            events += self._close_text()
            item = function_call_item(
                function.get("name") or "", "", call.get("id") or "", status="in_progress"
            )
            self._calls[index] = item
            events.append(self._add(item))
        fragment = function.get("arguments") or ""
        if fragment:
            item["arguments"] += fragment
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.items.index(item),
                    delta=fragment,
                )
            )
        return events

    def close(self) -> list[str]:
        """Close every open item (the answer is complete)."""
        events = self._close_text()
        for item in self._calls.values():
            where = {"item_id": item["id"], "output_index": self.items.index(item)}
            events.append(
                self.event("response.function_call_arguments.done", **where, arguments=item["arguments"])
            )
            item["status"] = "completed"
            events.append(
                self.event("response.output_item.done", output_index=where["output_index"], item=item)
            )
        self._calls = {}
        return events

    def assistant_message(self) -> dict[str, Any]:
        """The answer as the chat message a later request (previous_response_id) continues from."""
        text = "".join(
            part["text"] for item in self.items if item["type"] == "message" for part in item["content"]
        )
        calls = [
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            for item in self.items
            if item["type"] == "function_call"
        ]
        return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
