"""Tool-call parsers: each reads one model family's way of writing tool calls into OpenAI's shape."""

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ParsedText,
    ToolParser,
    ToolParserManager,
)
from pagedllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from pagedllm.entrypoints.openai.tool_parsers.json_calls import ToolCallPrefix
from pagedllm.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser

__all__ = [
    "ExtractedToolCallInformation",
    "Hermes2ProToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ParsedText",
    "PythonicToolParser",
    "ToolCallPrefix",
    "ToolParser",
    "ToolParserManager",
]
