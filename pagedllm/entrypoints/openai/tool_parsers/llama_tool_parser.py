"""Llama 3.1/3.2 JSON tool calls: the output is one or more ``{"name": ..., "parameters": {...}}`` objects
separated by ``;``, optionally after ``<|python_tag|>``; any other output is plain content."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedText,
    ToolParser,
    ToolParserManager,
)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import is_valid_call, read_call, skip_ws

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    markers = (PYTHON_TAG,)

    def parse(self, text: str, final: bool) -> ParsedText:
        pos = skip_ws(text, len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0)
        if not final and (pos >= len(text) or PYTHON_TAG.startswith(text)):
            # Only whitespace, or the start of the tag, so far: the output may still be a call.
            return ParsedText("")
        if pos >= len(text) or text[pos] != "{":
            return ParsedText(text)
        calls = []
        while True:
            call, end = read_call(text, pos, ARGUMENT_KEYS)
            if final and (end is None or not is_valid_call(text[pos:end], ARGUMENT_KEYS)):
                return ParsedText(text)
            if call is not None:
                calls.append(call)
            if end is None:
                return ParsedText("", calls)
            pos = skip_ws(text, end)
            if pos < len(text) and text[pos] == ";":
                pos = skip_ws(text, pos + 1)
            if pos >= len(text):
                return ParsedText("", calls)
            if text[pos] != "{":
                return ParsedText(text) if final else ParsedText("", calls)
