"""A reasoning model's chat responses through the real server (`--reasoning-parser qwen3`) with the
official openai client. SmolLM2 never writes <think> by itself, so a regex makes it write the tags as
text: the split, streamed and not, is then deterministic. Also: outputs without tags are reasoning (cut
before </think>) unless thinking is off, include_reasoning=false drops the reasoning, and
chat_template_kwargs reach the template."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from remote_server import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow

# SmolLM2 has no single </think> token: the engine warns and constrains the whole output, tags included.
THINK_REGEX = r"<think>[a-z ]{2,8}</think>[a-z ]{2,8}"
MESSAGES = [{"role": "user", "content": "Is the sky blue? Answer in a few words."}]


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    # Request templates: test_chat_template_kwargs_reach_the_template sends its own.
    remote = RemoteServer(extra_args=["--reasoning-parser", "qwen3", "--trust-request-chat-template"])
    try:
        yield remote
    finally:
        remote.kill()


def chat(client: openai.OpenAI, max_tokens: int = 32, **extra_body: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0.0, max_tokens=max_tokens, extra_body=extra_body
    )


def chat_stream(client: openai.OpenAI, max_tokens: int = 32, **extra_body: Any) -> tuple[str, str]:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        temperature=0.0,
        max_tokens=max_tokens,
        stream=True,
        extra_body=extra_body,
    )
    reasoning, content = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    return reasoning, content


def test_think_tags_split_into_reasoning_and_content(client: openai.OpenAI) -> None:
    message = chat(client, guided_regex=THINK_REGEX).choices[0].message
    match = re.fullmatch(
        r"<think>(.*)</think>(.*)", f"<think>{message.reasoning_content}</think>{message.content}"
    )
    assert match and re.fullmatch(THINK_REGEX, match.group(0)), message
    assert message.reasoning == message.reasoning_content  # vLLM's name and its older alias
    assert "<think>" not in (message.content or "") and "</think>" not in message.reasoning_content
    assert chat_stream(client, guided_regex=THINK_REGEX) == (message.reasoning_content, message.content)
    # include_reasoning=false: the same content, without the reasoning.
    hidden = chat(client, guided_regex=THINK_REGEX, include_reasoning=False).choices[0].message
    assert hidden.content == message.content and hidden.reasoning_content is None
    # enable_thinking=false: the qwen3 parser leaves the whole text as content.
    off = chat(client, guided_regex=THINK_REGEX, chat_template_kwargs={"enable_thinking": False})
    assert off.choices[0].message.content == f"<think>{message.reasoning_content}</think>{message.content}"
    assert off.choices[0].message.reasoning_content is None


def test_output_without_tags_is_reasoning_unless_thinking_is_off(client: openai.OpenAI) -> None:
    """As vLLM's qwen3 parser now: the template opened <think> in the prompt (Qwen3-Thinking-2507,
    Qwen3.5), so output cut before </think> is all reasoning; enable_thinking=false makes it content."""
    message = chat(client, max_tokens=8).choices[0].message
    assert message.reasoning_content and message.content is None
    assert chat_stream(client, max_tokens=8) == (message.reasoning_content, "")
    off = chat(client, max_tokens=8, chat_template_kwargs={"enable_thinking": False}).choices[0].message
    assert off.content == message.reasoning_content and off.reasoning_content is None


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI) -> None:
    template = (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    )

    def prompt_tokens(**kwargs: Any) -> int:
        response = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=1,
            extra_body={"chat_template": template, **kwargs},
        )
        return response.usage.prompt_tokens

    default = prompt_tokens()
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == default
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > default
