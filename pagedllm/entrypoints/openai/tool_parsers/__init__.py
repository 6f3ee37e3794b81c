"""Tool-call parsers: each reads one model family's way of writing tool calls into OpenAI's shape."""

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
)
from pagedllm.entrypoints.openai.tool_parsers.deepseekv3_tool_parser import DeepSeekV3ToolParser
from pagedllm.entrypoints.openai.tool_parsers.granite_tool_parser import GraniteToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from pagedllm.entrypoints.openai.tool_parsers.internlm_tool_parser import InternLMToolParser
from pagedllm.entrypoints.openai.tool_parsers.jamba_tool_parser import JambaToolParser
from pagedllm.entrypoints.openai.tool_parsers.json_calls import ParsedText, ToolCallPrefix
from pagedllm.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.openai_tool_parser import OpenAIToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser
from pagedllm.entrypoints.openai.tool_parsers.qwen3coder_tool_parser import Qwen3CoderToolParser

__all__ = [
    "DeepSeekV3ToolParser",
    "ExtractedToolCallInformation",
    "GraniteToolParser",
    "Hermes2ProToolParser",
    "InternLMToolParser",
    "JambaToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "OpenAIToolParser",
    "ParsedText",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "ToolCallPrefix",
    "ToolParser",
    "ToolParserManager",
]
