"""The `<think>...</think>` parsers."""

from __future__ import annotations

from pagedllm.reasoning.parser import ReasoningParser, partial_marker_len, register_reasoning_parser


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and QwQ, R1 distills): the chat template opens `<think>` in the prompt, so the
    output starts inside the reasoning; a `<think>` the model writes itself (after whitespace or not) is
    dropped; `</think>` ends the reasoning. Output without `</think>` is all reasoning (it was cut off
    while thinking)."""

    implicit_start = True


TOOL_CALL = "<tool_call>"
# What follows a `<tool_call>` that really opens a call: Qwen3.5/Qwen3-Coder's XML or Qwen3's JSON.
_CALL_OPENINGS = ("<function", "{")


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

    def reasoning_end(self, text: str, body: int, final: bool) -> tuple[int, int | None]:
        end, content_start = super().reasoning_end(text, body, final)
        pos = text.find(TOOL_CALL, body, end)
        while pos >= 0:
            after = text[pos + len(TOOL_CALL) :].lstrip()
            if after.startswith(_CALL_OPENINGS):
                return pos, pos  # the call is content, for the tool parser
            if not final and any(opening.startswith(after) for opening in _CALL_OPENINGS):
                return pos, None  # a call may be opening: not reasoning until that is known
            pos = text.find(TOOL_CALL, pos + 1, end)
        if content_start is None and not final:
            end = min(end, len(text) - partial_marker_len(text[body:], TOOL_CALL))
        return end, content_start
