"""InternLM2/2.5 tool calls: content, then ``<|action_start|><|plugin|>``, one JSON object ``{"name": ...,
"parameters": {...}}`` and ``<|action_end|>`` (InternLM calls one tool per turn)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager
from pagedllm.entrypoints.openai.tool_parsers.json_calls import (
    ParsedText,
    content_before_markers,
    is_valid_call,
    read_call,
    skip_ws,
)

START = "<|action_start|><|plugin|>"
END = "<|action_end|>"
ARGUMENT_KEYS = ("parameters", "arguments")


@ToolParserManager.register_module(["internlm", "internlm2"])
class InternLMToolParser(ToolParser):
    markers = ("<|action_start|>", "<|plugin|>", END)

    def parse(self, text: str, final: bool) -> ParsedText:
        content, start = content_before_markers(text, (START,), final)
        if start < 0:
            return ParsedText(content)
        pos = skip_ws(text, start + len(START))
        if pos >= len(text) or text[pos] != "{":
            return ParsedText(text if final else content)
        call, end = read_call(text, pos, ARGUMENT_KEYS)
        if final and (end is None or not is_valid_call(text[pos:end], ARGUMENT_KEYS)):
            return ParsedText(text)
        return ParsedText(content, [] if call is None else [call])
