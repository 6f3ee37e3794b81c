"""A real server whose step budget is small, so that a long prompt is prefilled in several chunks:
streamed echo with logprobs (prompt logprobs arrive in pieces) and the queue-time metric."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion
from remote_server import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow

# Tokens per engine step: a prompt of LONG_PROMPT's length takes many steps to prefill.
STEP_BUDGET = 32
SHORT_PROMPT = "The capital of France is"
LONG_PROMPT = "Paris is the capital of France, and Lyon is a large city in the south east. " * 12


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    remote = RemoteServer(extra_args=["--max-num-batched-tokens", str(STEP_BUDGET)])
    try:
        yield remote
    finally:
        remote.kill()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def num_prompt_tokens(server: RemoteServer, prompt: str) -> int:
    response = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}, timeout=30)
    assert response.status_code == 200, response.text
    return len(response.json()["tokens"])


def test_long_prompt_needs_several_chunks(server: RemoteServer) -> None:
    # Otherwise the tests below would not see prompt logprobs in pieces.
    assert num_prompt_tokens(server, LONG_PROMPT) > 4 * STEP_BUDGET


# --------------------------------------------------------------------------- streamed echo + logprobs
def assemble(chunks: list[Completion], n: int) -> list[dict[str, Any]]:
    """Per choice, the streamed pieces joined: text and the four logprobs lists."""
    choices = [
        {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": [], "chunks": []}
        for _ in range(n)
    ]
    for chunk in chunks:
        for choice in chunk.choices:
            joined = choices[choice.index]
            joined["chunks"].append(choice)
            joined["text"] += choice.text
            assert choice.logprobs is not None
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                joined[key].extend(getattr(choice.logprobs, key))
            if choice.finish_reason is not None:
                joined["finish_reason"] = choice.finish_reason
    return choices


@pytest.mark.parametrize(
    ("prompt", "n"), [(SHORT_PROMPT, 1), (LONG_PROMPT, 1), (LONG_PROMPT, 2)], ids=["short", "long", "long-n2"]
)
def test_streamed_echo_with_logprobs_equals_full(
    server: RemoteServer, client: openai.OpenAI, prompt: str, n: int
) -> None:
    # Seeded sampling (greedy for n = 1): the streamed run samples what the full one did.
    args: dict[str, Any] = dict(
        model=MODEL_NAME, prompt=prompt, max_tokens=8, echo=True, logprobs=2, n=n, seed=11,
        temperature=0.0 if n == 1 else 1.0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    full = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and full.usage is not None
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 8 * n
    num_prompt = num_prompt_tokens(server, prompt)
    streamed = assemble(chunks[:-1], n)
    for expected, got in zip(sorted(full.choices, key=lambda c: c.index), streamed, strict=True):
        # The prompt and all its logprobs come first, in the choice's first chunk.
        first = got["chunks"][0]
        assert first.text.startswith(prompt)
        assert len(first.logprobs.tokens) >= num_prompt
        assert first.logprobs.token_logprobs[0] is None and None not in first.logprobs.token_logprobs[1:]
        assert got["text"] == expected.text
        assert got["finish_reason"] == expected.finish_reason == "length"
        logprobs = expected.logprobs
        assert logprobs is not None
        assert len(got["tokens"]) == num_prompt + 8
        assert got["tokens"] == logprobs.tokens
        assert got["text_offset"] == logprobs.text_offset
        assert got["token_logprobs"][0] is None
        assert got["token_logprobs"][1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-4)
        assert got["top_logprobs"][0] is None
        for mine, theirs in zip(got["top_logprobs"][1:], logprobs.top_logprobs[1:], strict=True):
            assert mine == pytest.approx(theirs, abs=1e-4)


# --------------------------------------------------------------------------------------- queue time
def histogram_sums(server: RemoteServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r'^vllm:(\w+_seconds_(?:sum|count))\{model_name="([^"]*)"\} (\S+)$', line)
        if match and match.group(2) == MODEL_NAME:
            values[match.group(1)] = float(match.group(3))
    return values


def test_queue_time_ends_before_the_first_token(client: openai.OpenAI, server: RemoteServer) -> None:
    before = histogram_sums(server)
    client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    after = histogram_sums(server)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["request_queue_time_seconds_count"] == 1
    assert delta["time_to_first_token_seconds_count"] == 1
    queue, ttft = delta["request_queue_time_seconds_sum"], delta["time_to_first_token_seconds_sum"]
    # The queue time ends when the core first scheduled the request, so it leaves out the prefill's
    # many steps, which the time to first token includes.
    assert 0.0 < queue < ttft
