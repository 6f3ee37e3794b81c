"""IBM Granite 3.x tool calls: the output is ``<|tool_call|>`` (Granite 3.0's special token) or
``<tool_call>`` (3.1 and later), then a JSON list of ``{"name": ..., "arguments": {...}}`` objects; any
other output is plain content."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager
from pagedllm.entrypoints.openai.tool_parsers.json_calls import ParsedText, call_list_so_far, skip_ws

BOT_TOKEN = "<|tool_call|>"
BOT_STRING = "<tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")


@ToolParserManager.register_module("granite")
class GraniteToolParser(ToolParser):
    markers = (BOT_TOKEN,)

    def parse(self, text: str, final: bool) -> ParsedText:
        pos = skip_ws(text, 0)
        for marker in (BOT_TOKEN, BOT_STRING):
            if text.startswith(marker, pos):
                pos = skip_ws(text, pos + len(marker))
            elif not final and marker.startswith(text[pos:]):
                return ParsedText("")  # only whitespace, or the start of a marker, so far
        calls = call_list_so_far(text, pos, ARGUMENT_KEYS, final)
        return ParsedText(text) if calls is None else ParsedText("", calls)
