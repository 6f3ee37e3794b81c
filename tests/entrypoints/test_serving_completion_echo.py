"""Streamed echo with logprobs in the completion handler, with scripted engine outputs (no model): the
prompt's logprobs arrive in pieces, and the stream must add up to the full response."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.request_limits import RequestLimits
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput

# Token id -> text; the prompt is tokens 0, 1, 2.
TEXTS = {0: "The", 1: " sky", 2: " is", 3: " blue", 4: " grey", 5: ".", 6: "!"}
PROMPT_IDS = [0, 1, 2]
PROMPT = "The sky is"


class FakeTokenizer:
    def decode(self, token_ids: list[int]) -> str:
        return "".join(TEXTS[t] for t in token_ids)


class FakeEngine:
    tokenizer = FakeTokenizer()


class ScriptedStream:
    """Stands in for a RequestStream: yields the given outputs."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs = outputs

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        for output in self.outputs:
            yield output

    def abort(self) -> None:
        pass


def row(token: int, logprob: float) -> dict[int, Logprob]:
    """A logprobs row: the token and the one other candidate (token 6) as top-1."""
    return {token: Logprob(logprob, 2, TEXTS[token]), 6: Logprob(-0.1, 1, TEXTS[6])}


PROMPT_ROWS: PromptLogprobs = [None, row(1, -2.5), row(2, -1.25)]


def piece(index: int, tokens: list[int], finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(
        index=index,
        text="".join(TEXTS[t] for t in tokens),
        token_ids=tokens,
        cumulative_logprob=None,
        logprobs=[row(t, -0.5 * (t + 1)) for t in tokens],
        finish_reason=finish,
    )


def output(completions: list[CompletionOutput], prompt_rows: PromptLogprobs | None) -> RequestOutput:
    finished = bool(completions) and all(c.finished() for c in completions)
    return RequestOutput("cmpl", PROMPT, PROMPT_IDS, prompt_rows, completions, finished)


def run_stream(request: CompletionRequest, outputs: list[RequestOutput]) -> list[dict[str, Any]]:
    """The stream's choices, one per SSE chunk."""
    serving = OpenAIServingCompletion(FakeEngine(), None, None, RequestLimits(n=1))  # type: ignore[arg-type]

    async def collect() -> list[str]:
        stream = ScriptedStream(outputs)
        return [line async for line in serving._stream(request, "cmpl", "m", [stream])]  # type: ignore[list-item]

    lines = asyncio.run(collect())
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    return [choice for chunk in chunks for choice in chunk["choices"]]


def run_full(request: CompletionRequest, final: RequestOutput) -> list[dict[str, Any]]:
    serving = OpenAIServingCompletion(FakeEngine(), None, None, RequestLimits(n=1))  # type: ignore[arg-type]
    response = asyncio.run(serving._full(request, "cmpl", "m", [ScriptedStream([final])]))  # type: ignore[list-item]
    return [choice.model_dump() for choice in response.choices]


def joined(choices: list[dict[str, Any]], index: int) -> dict[str, Any]:
    mine = [c for c in choices if c["index"] == index]
    result: dict[str, Any] = {
        "text": "".join(c["text"] for c in mine),
        "finish_reason": mine[-1]["finish_reason"],
    }
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        result[key] = [v for c in mine for v in c["logprobs"][key]]
    return result


def as_joined(choice: dict[str, Any]) -> dict[str, Any]:
    """A full response's choice in `joined`'s shape."""
    return {"text": choice["text"], "finish_reason": choice["finish_reason"], **choice["logprobs"]}


def make_request(n: int, stream: bool) -> CompletionRequest:
    return CompletionRequest(prompt=PROMPT, n=n, echo=True, logprobs=1, max_tokens=2, stream=stream)


def test_prompt_logprobs_in_pieces_come_first_and_whole() -> None:
    # DELTA outputs of a chunked prefill: one prompt row, then the rest with the first token.
    outputs = [
        output([piece(0, [])], PROMPT_ROWS[:2]),
        output([piece(0, [3])], PROMPT_ROWS[2:]),
        output([piece(0, [5], finish="length")], None),
    ]
    streamed = run_stream(make_request(1, stream=True), outputs)
    # Nothing is sent for the mid-prefill output: the first chunk holds the echo, whole.
    assert [c["text"] for c in streamed] == [PROMPT + " blue", "."]
    assert streamed[0]["logprobs"]["tokens"] == ["The", " sky", " is", " blue"]
    final = output([piece(0, [3, 5], finish="length")], PROMPT_ROWS)
    [full] = run_full(make_request(1, stream=False), final)
    assert joined(streamed, 0) == as_joined(full)


@pytest.mark.parametrize("late_piece_with_token", [True, False])
def test_a_choice_ahead_of_the_prompt_logprobs_is_held_back(late_piece_with_token: bool) -> None:
    # n = 2: the second child samples before the first child's prefill (whose prompt logprobs the
    # parent reports) is complete.
    last_prompt_piece = [piece(0, [3])] if late_piece_with_token else [piece(0, [])]
    outputs = [
        output([piece(0, [])], PROMPT_ROWS[:2]),
        output([piece(1, [4])], None),
        output(last_prompt_piece, PROMPT_ROWS[2:]),
        output([piece(1, [6], finish="length")], None),
        output([piece(0, [3, 5] if not late_piece_with_token else [5], finish="length")], None),
    ]
    streamed = run_stream(make_request(2, stream=True), outputs)
    assert all(c["text"] for c in streamed)
    for index in (0, 1):
        first = next(c for c in streamed if c["index"] == index)
        assert first["text"].startswith(PROMPT)
        assert first["logprobs"]["tokens"][:3] == ["The", " sky", " is"]
        assert first["logprobs"]["token_logprobs"][:3] == [None, -2.5, -1.25]
    final = output([piece(0, [3, 5], finish="length"), piece(1, [4, 6], finish="length")], PROMPT_ROWS)
    full = run_full(make_request(2, stream=False), final)
    for choice in full:
        assert joined(streamed, choice["index"]) == as_joined(choice)


def final_output(tokens: list[int]) -> RequestOutput:
    return output([piece(0, tokens, finish="length")], PROMPT_ROWS)


def test_echo_with_max_tokens_0_is_the_prompt_alone() -> None:
    # lm-evaluation-harness' loglikelihood request: the prompt back with each of its tokens' logprobs.
    request = CompletionRequest(prompt=PROMPT, echo=True, max_tokens=0, logprobs=1)
    # The engine samples one token (it cannot sample none); it is not part of the answer.
    assert request.to_sampling_params().max_tokens == 1
    (choice,) = run_full(request, final_output([3]))
    assert choice["text"] == PROMPT
    assert choice["logprobs"]["tokens"] == ["The", " sky", " is"]
    assert choice["logprobs"]["token_logprobs"] == [None, -2.5, -1.25]
    assert choice["logprobs"]["top_logprobs"] == [None, {" sky": -2.5, "!": -0.1}, {" is": -1.25, "!": -0.1}]
    streamed = run_stream(request.model_copy(update={"stream": True}), [final_output([3])])
    assert as_joined(choice) == joined(streamed, 0)
    with pytest.raises(ValueError, match="max_tokens must be at least 1") as info:
        CompletionRequest(prompt=PROMPT, max_tokens=0).to_sampling_params()
    assert info.value.param == "max_tokens"  # type: ignore[attr-defined]


def test_prompt_logprobs_in_vllms_shape() -> None:
    request = CompletionRequest(prompt=PROMPT, prompt_logprobs=1, max_tokens=1)
    (choice,) = run_full(request, final_output([3]))
    assert choice["logprobs"] is None  # only the prompt's were asked for
    assert choice["prompt_logprobs"] == [
        None,
        {
            1: {"logprob": -2.5, "rank": 2, "decoded_token": " sky"},
            6: {"logprob": -0.1, "rank": 1, "decoded_token": "!"},
        },
        {
            2: {"logprob": -1.25, "rank": 2, "decoded_token": " is"},
            6: {"logprob": -0.1, "rank": 1, "decoded_token": "!"},
        },
    ]


def test_tokens_as_token_ids() -> None:
    request = CompletionRequest(
        prompt=PROMPT, echo=True, max_tokens=1, logprobs=1, return_tokens_as_token_ids=True
    )
    (choice,) = run_full(request, final_output([3]))
    assert choice["logprobs"]["tokens"] == ["token_id:0", "token_id:1", "token_id:2", "token_id:3"]
    assert choice["logprobs"]["top_logprobs"][1] == {"token_id:1": -2.5, "token_id:6": -0.1}
    # Offsets count the strings as written.
    assert choice["logprobs"]["text_offset"] == [0, 10, 20, 30]
