"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes 2/3): ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``, one block per call, after optional content."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedText,
    ToolParser,
    ToolParserManager,
)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import (
    content_before_markers,
    is_valid_call,
    read_call,
    skip_ws,
)

START = "<tool_call>"
END = "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    markers = (START, END)

    def parse(self, text: str, final: bool) -> ParsedText:
        content, start = content_before_markers(text, (START,), final)
        if start < 0:
            return ParsedText(content)
        parsed = ParsedText(content)
        pos = start
        # Each block: the start tag, one JSON object, the end tag (the last one may be left open). Text
        # after the calls is dropped, as the model should stop there.
        while pos >= 0:
            object_start = skip_ws(text, pos + len(START))
            if object_start >= len(text):
                break
            if text[object_start] != "{":
                return ParsedText(text) if final else parsed
            call, end = read_call(text, object_start, ARGUMENT_KEYS)
            if final and (end is None or not is_valid_call(text[object_start:end], ARGUMENT_KEYS)):
                return ParsedText(text)
            if call is not None:
                parsed.tool_calls.append(call)
            if end is None:
                break
            pos = text.find(START, end)
        return parsed
