"""Mistral tool calls: content, then ``[TOOL_CALLS]`` and a JSON list of ``{"name": ..., "arguments":
{...}}`` objects (or, as some Mistral models write it, a single object)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedText,
    ToolParser,
    ToolParserManager,
)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import (
    held_back,
    is_valid_call,
    is_valid_call_list,
    read_call,
    read_call_list,
    skip_ws,
)

BOT = "[TOOL_CALLS]"
ARGUMENT_KEYS = ("arguments", "parameters")


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    markers = (BOT,)

    def parse(self, text: str, final: bool) -> ParsedText:
        start = text.find(BOT)
        if start < 0:
            return ParsedText(text if final else text[: len(text) - held_back(text, BOT)])
        content = text[:start]
        pos = skip_ws(text, start + len(BOT))
        if pos < len(text) and text[pos] == "[":
            calls, end = read_call_list(text, pos, ARGUMENT_KEYS)
            valid = end is not None and is_valid_call_list(text[pos:end], ARGUMENT_KEYS, len(calls))
        elif pos < len(text) and text[pos] == "{":
            call, end = read_call(text, pos, ARGUMENT_KEYS)
            calls = [] if call is None else [call]
            valid = end is not None and is_valid_call(text[pos:end], ARGUMENT_KEYS)
        else:
            calls, valid = [], False
        if final and not valid:
            return ParsedText(text)
        return ParsedText(content, calls)
