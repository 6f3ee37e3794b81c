"""AI21 Jamba tool calls: content, then ``<tool_calls>``, a JSON list of ``{"name": ..., "arguments":
{...}}`` objects and ``</tool_calls>``; text after the calls is dropped, as the model should stop there."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager
from pagedllm.entrypoints.openai.tool_parsers.json_calls import (
    ParsedText,
    call_list_so_far,
    content_before_markers,
    skip_ws,
)

START = "<tool_calls>"
END = "</tool_calls>"
ARGUMENT_KEYS = ("arguments", "parameters")


@ToolParserManager.register_module("jamba")
class JambaToolParser(ToolParser):
    markers = (START, END)

    def parse(self, text: str, final: bool) -> ParsedText:
        content, start = content_before_markers(text, (START,), final)
        if start < 0:
            return ParsedText(content)
        calls = call_list_so_far(text, skip_ws(text, start + len(START)), ARGUMENT_KEYS, final)
        if calls is None:  # not a list of calls: the whole text is content, once it is complete
            return ParsedText(text if final else content)
        return ParsedText(content, calls)
