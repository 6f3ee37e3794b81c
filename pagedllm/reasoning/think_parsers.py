"""The `<think>...</think>` parsers."""

from __future__ import annotations

from pagedllm.reasoning.parser import ReasoningParser, register_reasoning_parser


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and QwQ, R1 distills): the chat template opens `<think>` in the prompt, so the
    output starts inside the reasoning; a `<think>` the model writes itself is dropped; `</think>` ends
    the reasoning. Output without `</think>` is all reasoning (it was cut off while thinking)."""

    implicit_start = True


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the model writes `<think>...</think>` itself. Output that does not open with `<think>` is
    all content, and so is every output of a request with `chat_template_kwargs={"enable_thinking":
    false}` (the template then writes an empty think block into the prompt)."""

    def thinking_enabled(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking", True) is not False
