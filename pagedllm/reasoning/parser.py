"""The `ReasoningParser` base and the registry of parsers by name (vLLM's `--reasoning-parser` names).

A parser cuts a model output into (reasoning, content) at two marker strings. The same cut serves the
complete text and the stream: a streamed delta is the difference between the cuts of the text before
and after it, so the joined deltas always equal the complete result. While the text streams in, a tail
that could still grow into a marker (`</thi`) is held back until the next delta (or the end) decides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

_REGISTRY: dict[str, type[ReasoningParser]] = {}


class ReasoningDelta(NamedTuple):
    """What one streamed step adds to each part (None: nothing); the server turns it into its delta."""

    reasoning: str | None
    content: str | None


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


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (0 if none)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Reasoning between `start_token` and `end_token`. A `start_token` after leading whitespace is the
    marker too. `implicit_start`: the output begins inside the reasoning even without `start_token`
    (the chat template opened it in the prompt)."""

    start_token: ClassVar[str] = "<think>"
    end_token: ClassVar[str] = "</think>"
    implicit_start: ClassVar[bool] = False

    def __init__(
        self,
        vocab: Mapping[str, int],
        chat_template_kwargs: dict[str, Any] | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        """`vocab`: the tokenizer's token -> id (read once per tokenizer: building it is slow); one
        parser per request, for its `chat_template_kwargs`. `decode`: the tokenizer's ids -> text, for
        a parser whose markers on token ids depend on the text that follows them (None: such a marker
        is never confirmed on ids)."""
        # None when the vocabulary has no single token for a marker: the text cut still works, but
        # the engine cannot see the reasoning end in the token ids (see `has_end_token`).
        self.start_token_id: int | None = vocab.get(self.start_token)
        self.end_token_id: int | None = vocab.get(self.end_token)
        self.vocab = vocab
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.decode = decode

    @property
    def has_end_token(self) -> bool:
        return self.end_token_id is not None

    def thinking_enabled(self) -> bool:
        """False when the request turned reasoning off; then the whole output is content."""
        return True

    # -- the engine side: token ids --------------------------------------------------------------
    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether `input_ids` end outside the reasoning: the last marker among them is the end one.
        Scanning from the end lets a prompt with earlier turns' `</think>` but a fresh `<think>` count
        as still reasoning."""
        for token_id in reversed(input_ids):
            if token_id == self.start_token_id:
                return False
            if token_id == self.end_token_id:
                return True
        return False

    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        """The ids of the content among the output's `input_ids`: those after the end marker (none while
        the reasoning goes on); all of them when the request turned reasoning off."""
        if not self.thinking_enabled():
            return list(input_ids)
        ids = list(input_ids)
        if self.end_token_id is None or self.end_token_id not in ids:
            return []
        return ids[ids.index(self.end_token_id) + 1 :]

    # -- the server side: text --------------------------------------------------------------------
    def split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        """(reasoning, content) of `text`; reasoning None when the text has no reasoning part, "" for
        an empty one. With `final` False (the text may still grow), what could become a marker is held
        back: it belongs to neither part yet."""
        if not self.thinking_enabled():
            return None, text
        lead = len(text) - len(text.lstrip())
        if text.startswith(self.start_token, lead):
            body = lead + len(self.start_token)
        elif not final and self.start_token.startswith(text[lead:]):
            return None, ""  # whitespace, or the start of the marker, so far
        elif self.implicit_start:
            body = 0
        else:
            return None, text
        reasoning_end, content_start = self.reasoning_end(text, body, final)
        return text[body:reasoning_end], "" if content_start is None else text[content_start:]

    def reasoning_end(self, text: str, body: int, final: bool) -> tuple[int, int | None]:
        """Where the reasoning starting at `body` ends, and where the content starts: None while the
        reasoning goes on (then, before the final text, a tail that may start the end marker is not
        reasoning yet)."""
        index = text.find(self.end_token, body)
        if index >= 0:
            return index, index + len(self.end_token)
        return len(text) - (0 if final else partial_marker_len(text[body:], self.end_token)), None

    def extract_reasoning_content(self, model_output: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a complete output: reasoning None without a reasoning part
        ("" for an empty one, as vLLM), content None when empty."""
        reasoning, content = self.split(model_output)
        return reasoning, content or None

    def extract_reasoning_content_streaming(
        self, previous_text: str, current_text: str, finished: bool = False
    ) -> ReasoningDelta | None:
        """The delta of one streamed step: `current_text` is `previous_text` plus the new text;
        `finished` releases whatever was held back. None when the step adds nothing to either part."""
        old_reasoning, old_content = self.split(previous_text, final=False)
        reasoning, content = self.split(current_text, final=finished)
        new_reasoning = (reasoning or "")[len(old_reasoning or "") :]
        new_content = content[len(old_content) :]
        if not new_reasoning and not new_content:
            return None
        return ReasoningDelta(reasoning=new_reasoning or None, content=new_content or None)
