"""The `ReasoningParser` base and the registry of parsers by name (vLLM's `--reasoning-parser` names).

A parser cuts a model output into (reasoning, content) at two marker strings. The same cut serves the
complete text and the stream: a streamed delta is the difference between the cuts of the text before
and after it, so the joined deltas always equal the complete result. While the text streams in, a tail
that could still grow into a marker (`</thi`) is held back until the next delta (or the end) decides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from pagedllm.entrypoints.openai.protocol_chat import DeltaMessage

_REGISTRY: dict[str, type[ReasoningParser]] = {}


def register_reasoning_parser(name: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    def register(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        _REGISTRY[name] = cls
        return cls

    return register


def reasoning_parser_names() -> list[str]:
    _load_builtin_parsers()
    return sorted(_REGISTRY)


def get_reasoning_parser(name: str, field: str = "reasoning_parser") -> type[ReasoningParser]:
    """The parser class registered as `name`; a ValueError naming `field` and listing the known names
    otherwise."""
    _load_builtin_parsers()
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(
            f"{field}={name!r} is not a reasoning parser; choose one of: {', '.join(reasoning_parser_names())}"
        )
    return cls


def _load_builtin_parsers() -> None:
    # Imported here, not at the top: the parser modules import this one to register themselves.
    import pagedllm.reasoning.think_parsers  # noqa: F401


def _partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (0 if none)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Reasoning between `start_token` and `end_token`. `implicit_start`: the output begins inside the
    reasoning even without `start_token` (the chat template opened it in the prompt)."""

    start_token: ClassVar[str] = "<think>"
    end_token: ClassVar[str] = "</think>"
    implicit_start: ClassVar[bool] = False

    def __init__(self, vocab: Mapping[str, int], chat_template_kwargs: dict[str, Any] | None = None) -> None:
        """`vocab`: the tokenizer's token -> id (read once per tokenizer: building it is slow); one
        parser per request, for its `chat_template_kwargs`."""
        # None when the vocabulary has no single token for a marker: the text cut still works, but
        # the engine cannot see the reasoning end in the token ids (see `has_end_token`).
        self.start_token_id: int | None = vocab.get(self.start_token)
        self.end_token_id: int | None = vocab.get(self.end_token)
        self.chat_template_kwargs = chat_template_kwargs or {}

    @property
    def has_end_token(self) -> bool:
        return self.end_token_id is not None

    def thinking_enabled(self) -> bool:
        """False when the request turned reasoning off; then the whole output is content."""
        return True

    # -- the engine side: token ids --------------------------------------------------------------
    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether `token_ids` end outside the reasoning: the last marker among them is the end one.
        Scanning from the end lets a prompt with earlier turns' `</think>` but a fresh `<think>` count
        as still reasoning."""
        for token_id in reversed(token_ids):
            if token_id == self.start_token_id:
                return False
            if token_id == self.end_token_id:
                return True
        return False

    # -- the server side: text --------------------------------------------------------------------
    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        """(reasoning, content) of `text`. With `final` False (the text may still grow), what could
        become a marker is held back: it belongs to neither part yet."""
        if not self.thinking_enabled():
            return "", text
        if not final and len(text) < len(self.start_token) and self.start_token.startswith(text):
            return "", ""
        if text.startswith(self.start_token):
            body = text[len(self.start_token) :]
        elif self.implicit_start:
            body = text
        else:
            return "", text
        reasoning, found, content = body.partition(self.end_token)
        if not found and not final:
            reasoning = reasoning[: len(reasoning) - _partial_marker_len(reasoning, self.end_token)]
        return reasoning, content

    def extract_reasoning_content(self, model_output: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a complete output; None for an empty part."""
        reasoning, content = self.split(model_output)
        return reasoning or None, content or None

    def extract_reasoning_content_streaming(
        self, previous_text: str, current_text: str, finished: bool = False
    ) -> DeltaMessage | None:
        """The delta of one streamed step: `current_text` is `previous_text` plus the new text;
        `finished` releases whatever was held back. None when the step adds nothing to either part."""
        old_reasoning, old_content = self.split(previous_text, final=False)
        reasoning, content = self.split(current_text, final=finished)
        new_reasoning = reasoning[len(old_reasoning) :]
        new_content = content[len(old_content) :]
        if not new_reasoning and not new_content:
            return None
        return DeltaMessage(reasoning_content=new_reasoning or None, content=new_content or None)
