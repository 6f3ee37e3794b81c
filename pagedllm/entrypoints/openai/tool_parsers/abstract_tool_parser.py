"""The tool parser interface, and the registry that finds a parser by its --tool-call-parser name.

A parser reads one choice's output text (after any reasoning was split off) into the content and the
tool calls. It implements a single method, `parse(text, final)`: with ``final`` false the text may still
grow, and the parser answers with what is certain so far (content that cannot turn out to start a call,
calls whose name is known, a prefix of their arguments); with ``final`` true it answers for the complete
text, and returns the whole text as content when the calls do not parse. The base class turns the
successive partial readings of a stream into OpenAI's incremental ``delta.tool_calls``, so a streamed
answer joins into the same content and calls as the non-streamed one.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pagedllm.entrypoints.openai.protocol import make_tool_call_id
from pagedllm.entrypoints.openai.protocol_chat import (
    ChatCompletionToolsParam,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import ParsedText


@dataclass
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall]
    # None when the output holds only tool calls.
    content: str | None


@dataclass
class _SentCall:
    arguments_sent: int = 0


class ToolParser:
    """Base of every tool parser; one instance per choice, since a stream keeps its state in it."""

    # Marker texts of the format: when the tokenizer has one as a special token, the output must keep
    # special tokens for the parser to see it.
    markers: tuple[str, ...] = ()

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        # The request's tools (the server sets them before parsing): a format that writes arguments as
        # text, not JSON, reads their types from the parameter schemas.
        self.tools: list[ChatCompletionToolsParam] = []
        self._content_sent = 0
        self._calls_sent: list[_SentCall] = []
        self._stream_ended = False

    def parse(self, text: str, final: bool) -> ParsedText:
        raise NotImplementedError

    def make_call_id(self) -> str:
        """A fresh tool call id (a format whose chat template checks the ids sent back overrides it)."""
        return make_tool_call_id()

    def keeps_special_tokens(self) -> bool:
        """Whether the output text must keep special tokens (skip_special_tokens=False) for the markers."""
        special = set(getattr(self.tokenizer, "all_special_tokens", None) or ())
        return any(marker in special for marker in self.markers)

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        """The content and tool calls of a complete output."""
        parsed = self.parse(model_output, final=True)
        calls = [
            ToolCall(id=self.make_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in parsed.tool_calls
        ]
        return ExtractedToolCallInformation(
            tools_called=bool(calls), tool_calls=calls, content=parsed.content or None
        )

    def extract_tool_calls_streaming(
        self, current_text: str, finished: bool
    ) -> tuple[str | None, list[DeltaToolCall]]:
        """What a stream sends next, given the whole output so far: new content (None if none) and the
        tool-call deltas, at most one per call: a call's first delta carries its id, type, name and the
        arguments so far (a string, maybe empty), the next ones fragments of the arguments.
        ``finished`` says the text is complete, which releases anything held back."""
        if self._stream_ended:
            return None, []
        parsed = self.parse(current_text, final=finished)
        if len(parsed.tool_calls) < len(self._calls_sent):
            # The reading fell back to plain text (a call cut short by max_tokens, or malformed) after
            # calls were sent, which cannot be taken back: the stream ends with the deltas already sent,
            # as vLLM's does, rather than re-sending the raw text as content.
            self._stream_ended = True
            return None, []
        content = None
        if len(parsed.content) > self._content_sent:
            content = parsed.content[self._content_sent :]
            self._content_sent = len(parsed.content)
        deltas: list[DeltaToolCall] = []
        for index, call in enumerate(parsed.tool_calls):
            if index == len(self._calls_sent):
                self._calls_sent.append(_SentCall(len(call.arguments)))
                deltas.append(
                    DeltaToolCall(
                        index=index,
                        id=self.make_call_id(),
                        type="function",
                        function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
                    )
                )
                continue
            sent = self._calls_sent[index]
            if len(call.arguments) > sent.arguments_sent:
                fragment = call.arguments[sent.arguments_sent :]
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment)))
                sent.arguments_sent = len(call.arguments)
        return content, deltas

    @property
    def streamed_tool_calls(self) -> bool:
        return bool(self._calls_sent)


_ParserT = TypeVar("_ParserT", bound=type[ToolParser])


class ToolParserManager:
    """The tool parsers by name: the built-in ones, and those a --tool-parser-plugin file registers."""

    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(cls, name: str | list[str]) -> Callable[[_ParserT], _ParserT]:
        """A class decorator registering a parser under one or several names (a later one replaces an
        earlier one of the same name, so a plugin can override a built-in parser)."""
        names = [name] if isinstance(name, str) else name

        def register(parser: _ParserT) -> _ParserT:
            if not issubclass(parser, ToolParser):
                raise TypeError(f"{parser.__name__} must subclass ToolParser to be a tool parser")
            for each in names:
                cls.tool_parsers[each] = parser
            return parser

        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        try:
            return cls.tool_parsers[name]
        except KeyError:
            raise ValueError(
                f"--tool-call-parser {name!r} is not a known tool parser; choose one of "
                f"{', '.join(sorted(cls.tool_parsers))} (or register one with --tool-parser-plugin)"
            ) from None

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Run a user's Python file, which registers its parsers with `register_module`."""
        path = Path(plugin_path)
        if not path.is_file():
            raise ValueError(f"--tool-parser-plugin {plugin_path!r} is not a file")
        module_name = f"pagedllm_tool_parser_plugin_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--tool-parser-plugin {plugin_path!r} is not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[module_name]
            raise ValueError(f"--tool-parser-plugin {plugin_path!r} failed to load: {e}") from e
