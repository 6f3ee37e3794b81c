"""Chat responses of a reasoning model: the `--reasoning-parser` split of each choice's text into
`reasoning_content` and `content`, for complete responses and for streamed deltas.

The split runs before anything else reads the content (a tool-call parser parses what it leaves)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pagedllm.entrypoints.openai.protocol_chat import ChatCompletionRequest, ChatResponseMessage, DeltaMessage
from pagedllm.reasoning import ReasoningParser, get_reasoning_parser

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig


class ReasoningSplitter:
    """The server's reasoning parser (None: no --reasoning-parser, text is all content); `vocab` is read
    once here, not per request."""

    def __init__(self, engine_config: EngineConfig, tokenizer: Any) -> None:
        reasoning_config = engine_config.reasoning_config
        name = reasoning_config.reasoning_parser if reasoning_config is not None else ""
        self.parser_class: type[ReasoningParser] | None = get_reasoning_parser(name) if name else None
        self.vocab: Mapping[str, int] = tokenizer.get_vocab() if self.parser_class is not None else {}

    def for_request(self, request: ChatCompletionRequest) -> RequestReasoning:
        parser = None
        if self.parser_class is not None:
            parser = self.parser_class(self.vocab, request.chat_template_kwargs)
        return RequestReasoning(parser, request.include_reasoning)


class RequestReasoning:
    """One chat request's split; in a stream it keeps each choice's text so far."""

    def __init__(self, parser: ReasoningParser | None, include_reasoning: bool) -> None:
        self.parser = parser
        self.include_reasoning = include_reasoning
        self._texts: dict[int, str] = {}

    def message(self, text: str) -> ChatResponseMessage:
        if self.parser is None:
            return ChatResponseMessage(content=text)
        reasoning, content = self.parser.extract_reasoning_content(text)
        return ChatResponseMessage(
            reasoning_content=reasoning if self.include_reasoning else None, content=content
        )

    def delta(self, index: int, delta_text: str, finished: bool) -> DeltaMessage:
        """The delta of choice `index` that adds `delta_text`; `finished` on its last chunk."""
        if self.parser is None:
            return DeltaMessage(content=delta_text)
        previous = self._texts.get(index, "")
        current = self._texts[index] = previous + delta_text
        delta = self.parser.extract_reasoning_content_streaming(previous, current, finished)
        if delta is None:
            return DeltaMessage()
        reasoning = delta.reasoning if self.include_reasoning else None
        return DeltaMessage(reasoning_content=reasoning, content=delta.content)
