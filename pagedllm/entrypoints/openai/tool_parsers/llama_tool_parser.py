"""Llama 3.1/3.2 JSON tool calls: ``{"name": ..., "parameters": {...}}`` objects (``arguments`` is taken
too), several separated by ``;``, optionally after ``<|python_tag|>``, and possibly inside text (``Here is
the call: {...}``). An object is a call only with a string ``name`` and an object under ``parameters`` or
``arguments``; any other object (``{"name": "Alice"}``, ``{x}``) stays in the content, as does all the
text around the calls."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedText,
    ToolParser,
    ToolParserManager,
)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import read_call, skip_ws

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


def _is_call_object(raw: str) -> bool:
    """A complete object with a string name and object arguments under one of the argument keys."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return False
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return False
    present = [key for key in ARGUMENT_KEYS if key in value]
    return bool(present) and isinstance(value[present[0]], dict)


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    markers = (PYTHON_TAG,)

    def parse(self, text: str, final: bool) -> ParsedText:
        if not final and PYTHON_TAG.startswith(text):
            return ParsedText("")
        parsed = ParsedText("")
        pos = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
        while True:
            brace = text.find("{", pos)
            if brace < 0:
                parsed.content += text[pos:]
                break
            parsed.content += text[pos:brace]
            first = skip_ws(text, brace + 1)
            if first < len(text) and text[first] not in '"}':
                parsed.content += "{"  # a brace in prose or code, not a JSON object
                pos = brace + 1
                continue
            call, end = read_call(text, brace, ARGUMENT_KEYS)
            if end is None:
                # An object still open: a call once its arguments began (its name is known), else held
                # back until it closes (it may be a call, or JSON in the text).
                if final:
                    parsed.content += text[brace:]
                elif call is not None and call.arguments:
                    parsed.tool_calls.append(call)
                break
            if call is None or not _is_call_object(text[brace:end]):
                parsed.content += text[brace:end]
                pos = end
                continue
            parsed.tool_calls.append(call)
            after = skip_ws(text, end)
            if text.startswith(";", after):
                pos = skip_ws(text, after + 1)  # the separator between two calls is not content
            elif after >= len(text) and not final:
                break  # whitespace after a call: content, or the way to a separator
            else:
                pos = end
        if (parsed.tool_calls or not final) and not parsed.content.strip():
            # Whitespace around the calls is not an answer; while streaming it waits for what follows.
            parsed.content = ""
        return parsed
