"""The chat server's reasoning split on fixed model outputs (no model, no server): complete messages,
streamed deltas per choice (joined equal to the complete message), include_reasoning, and the response
fields (`reasoning` and its older alias `reasoning_content`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedllm.config.features import ReasoningConfig
from pagedllm.entrypoints.openai.protocol_chat import ChatCompletionRequest, ChatResponseMessage, DeltaMessage
from pagedllm.entrypoints.openai.serving_reasoning import ReasoningSplitter

OUTPUTS = ["<think>Two and two.</think>Four.", "Short answer: 4", "x</think>y"]


class Tokenizer:
    def get_vocab(self) -> dict[str, int]:
        return {"<think>": 5, "</think>": 6}


def splitter(parser: str | None) -> ReasoningSplitter:
    config = ReasoningConfig(reasoning_parser=parser) if parser else None
    return ReasoningSplitter(SimpleNamespace(reasoning_config=config), Tokenizer())


def request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "2+2?"}], **fields)


def streamed(parser: str | None, texts: list[str], **fields: object) -> list[tuple[str, str]]:
    """Each text streamed character by character, the choices interleaved as n > 1 streams them."""
    reasoning = splitter(parser).for_request(request(**fields))
    parts = [["", ""] for _ in texts]
    for step in range(max(map(len, texts))):
        for index, text in enumerate(texts):
            if step < len(text):
                delta = reasoning.delta(index, text[step], finished=step == len(text) - 1)
                parts[index][0] += delta.reasoning_content or ""
                parts[index][1] += delta.content or ""
    return [(r, c) for r, c in parts]


@pytest.mark.parametrize(
    ("parser", "expected"),
    [
        (None, [(None, text) for text in OUTPUTS]),
        # Qwen3's current templates open <think> in the prompt: output without </think> is reasoning.
        ("qwen3", [("Two and two.", "Four."), ("Short answer: 4", None), ("x", "y")]),
        ("deepseek_r1", [("Two and two.", "Four."), ("Short answer: 4", None), ("x", "y")]),
    ],
)
def test_messages_and_joined_deltas(parser: str | None, expected: list[tuple]) -> None:
    reasoning = splitter(parser).for_request(request())
    messages = [reasoning.message(text) for text in OUTPUTS]
    assert [(m.reasoning_content, m.content) for m in messages] == expected
    assert all(m.reasoning == m.reasoning_content for m in messages)
    assert streamed(parser, OUTPUTS) == [(r or "", c or "") for r, c in expected]


def test_include_reasoning_false_drops_only_the_reasoning() -> None:
    reasoning = splitter("deepseek_r1").for_request(request(include_reasoning=False))
    message = reasoning.message(OUTPUTS[0])
    assert (message.reasoning, message.reasoning_content, message.content) == (None, None, "Four.")
    assert streamed("deepseek_r1", OUTPUTS[:1], include_reasoning=False) == [("", "Four.")]


def test_enable_thinking_false_makes_everything_content() -> None:
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    message = splitter("qwen3").for_request(request(**kwargs)).message(OUTPUTS[0])
    assert (message.reasoning_content, message.content) == (None, OUTPUTS[0])


def test_response_json_carries_both_names() -> None:
    body = json.loads(ChatResponseMessage(reasoning_content="r", content="c").model_dump_json())
    assert body == {
        "reasoning": "r",
        "reasoning_content": "r",
        "role": "assistant",
        "content": "c",
        "tool_calls": [],
    }
    assert DeltaMessage(reasoning="r").reasoning_content == "r"


def test_unknown_parser_in_the_config_is_refused() -> None:
    with pytest.raises(
        ValueError, match="'think' is not a reasoning parser; choose one of: deepseek_r1, qwen3"
    ):
        ReasoningConfig(reasoning_parser="think")
