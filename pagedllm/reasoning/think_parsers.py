"""The `<think>...</think>` parsers."""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.reasoning.parser import ReasoningParser, partial_marker_len, register_reasoning_parser


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and QwQ, R1 distills): the chat template opens `<think>` in the prompt, so the
    output starts inside the reasoning; a `<think>` the model writes itself (after whitespace or not) is
    dropped; `</think>` ends the reasoning. Output without `</think>` is all reasoning (it was cut off
    while thinking)."""

    implicit_start = True


TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# What follows a `<tool_call>` that really opens a call: Qwen3.5/Qwen3-Coder's XML or Qwen3's JSON.
_CALL_OPENINGS = ("<function", "{")
# Tokens after a `<tool_call>` token that show what it opens: "\n<function=" is 3-5 tokens, "\n{" 1-2.
_CALL_LOOKAHEAD_TOKENS = 8


def _opens_call(after: str) -> bool:
    """Whether the text after a `<tool_call>` is a call (not a mention of the tag)."""
    return after.lstrip().startswith(_CALL_OPENINGS)


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 as vLLM reads it now: the chat templates of Qwen3-Thinking-2507 and Qwen3.5 open `<think>`
    in the prompt, so the output starts inside the reasoning (a `<think>` the model writes itself, as
    the first Qwen3 releases do, is dropped); everything up to `</think>` is reasoning, and output cut
    off before it is all reasoning. A tool call (`<tool_call>` then `<function=` or a JSON object) ends
    the reasoning too: Qwen3.5 may call a tool without closing its thoughts. With
    `chat_template_kwargs={"enable_thinking": false}` (the template then writes an empty think block
    into the prompt) the whole output is content."""

    implicit_start = True

    def thinking_enabled(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking", True) is not False

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """As the base, and a `<tool_call>` token that opens a call ends the reasoning too. One with a
        `</tool_call>` after it is not open: a finished call, or the example call of the tools' system
        prompt. Without `decode` a call cannot be told from a mention, so only `</think>` counts."""
        call_id, call_end_id = self.vocab.get(TOOL_CALL), self.vocab.get(TOOL_CALL_END)
        closed = False
        for i in range(len(input_ids) - 1, -1, -1):
            token_id = input_ids[i]
            if token_id == self.start_token_id:
                return False
            if token_id == self.end_token_id:
                return True
            closed = closed or token_id == call_end_id
            if token_id == call_id and not closed and self._call_at(input_ids, i):
                return True
        return False

    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        """As the base, but content starts at a call that comes before `</think>` (the call is content,
        for the tool parser), as the text split cuts it."""
        ids = list(input_ids)
        content = super().extract_content_ids(ids)
        call_id = self.vocab.get(TOOL_CALL)
        if not self.thinking_enabled() or call_id is None:
            return content
        end = ids.index(self.end_token_id) if self.end_token_id in ids else len(ids)
        for i in range(end):
            if ids[i] == call_id and self._call_at(ids, i):
                return ids[i:]
        return content

    def _call_at(self, ids: Sequence[int], pos: int) -> bool:
        """Whether the `<tool_call>` token at `pos` is followed by a call's opening in `ids`."""
        if self.decode is None:
            return False
        return _opens_call(self.decode(list(ids[pos + 1 : pos + 1 + _CALL_LOOKAHEAD_TOKENS])))

    def reasoning_end(self, text: str, body: int, final: bool) -> tuple[int, int | None]:
        end, content_start = super().reasoning_end(text, body, final)
        pos = text.find(TOOL_CALL, body, end)
        while pos >= 0:
            after = text[pos + len(TOOL_CALL) :].lstrip()
            if _opens_call(after):
                return pos, pos  # the call is content, for the tool parser
            if not final and any(opening.startswith(after) for opening in _CALL_OPENINGS):
                return pos, None  # a call may be opening: not reasoning until that is known
            pos = text.find(TOOL_CALL, pos + 1, end)
        if content_start is None and not final:
            end = min(end, len(text) - partial_marker_len(text[body:], TOOL_CALL))
        return end, content_start
