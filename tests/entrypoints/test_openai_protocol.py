"""Request models -> SamplingParams, and the OpenAI error shape, with no server."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.protocol_chat import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_utils import request_error
from pagedllm.errors import RequestError
from pagedllm.sampling_params import RequestOutputKind


def test_completion_request_sampling_params() -> None:
    request = CompletionRequest(
        prompt="x", max_tokens=7, temperature=0.5, top_k=3, min_p=0.1, repetition_penalty=1.2, ignore_eos=True,
        stop="END", seed=11, logprobs=2, logit_bias={"5": 1.5}, n=2,
    )  # fmt: skip
    params = request.to_sampling_params()
    assert (params.max_tokens, params.temperature, params.top_k, params.min_p) == (7, 0.5, 3, 0.1)
    assert (params.repetition_penalty, params.ignore_eos, params.seed, params.logprobs, params.n) == (
        1.2,
        True,
        11,
        2,
        2,
    )
    assert params.stop == ["END"]
    assert params.logit_bias == {5: 1.5}
    assert params.output_kind == RequestOutputKind.FINAL_ONLY
    # Fields the client did not give are left for the model's generation config.
    assert "top_p" not in params.user_set_fields
    assert (
        CompletionRequest(prompt="x", stream=True).to_sampling_params().output_kind == RequestOutputKind.DELTA
    )


def test_chat_request_token_limits_and_logprobs() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(messages=messages).to_sampling_params().max_tokens is None
    both = ChatCompletionRequest(messages=messages, max_tokens=9, max_completion_tokens=4)
    assert both.to_sampling_params().max_tokens == 4
    assert ChatCompletionRequest(messages=messages, max_tokens=9).to_sampling_params().max_tokens == 9
    assert ChatCompletionRequest(messages=messages).to_sampling_params().logprobs is None
    assert ChatCompletionRequest(messages=messages, logprobs=True).to_sampling_params().logprobs == 0
    top = ChatCompletionRequest(messages=messages, logprobs=True, top_logprobs=3)
    assert top.to_sampling_params().logprobs == 3


def test_unknown_fields_are_reported_not_rejected() -> None:
    request = CompletionRequest(prompt="x", frobnicate=1, zeta=2)
    assert request.ignored_fields() == ["frobnicate", "zeta"]


@pytest.mark.parametrize(
    ("error", "param"),
    [
        (RequestError("top_p", "top_p must be in (0, 1], got 1.5"), "top_p"),
        # The prompt is the request's own field: chat's messages, pooling's input.
        (RequestError("prompt", "The prompt has 600 tokens"), "messages"),
        # The constraint's errors name the field the constraint came from.
        (RequestError("structured_outputs", "structured_outputs.json is invalid"), "response_format"),
        # No guessing from the words of a message: a plain ValueError names no field.
        (ValueError("max_tokens=1000 is too large"), None),
    ],
)
def test_request_error_names_the_request_field(error: ValueError, param: str | None) -> None:
    mapped = request_error(error, "messages", "response_format")
    assert (mapped.status, mapped.param, mapped.message) == (400, param, str(error))


def test_models_check() -> None:
    models = OpenAIServingModels(["a", "b"], "/models/a", 512)
    assert models.check_model(None) == "a"
    assert models.check_model("b") == "b"
    with pytest.raises(OpenAIError) as info:
        models.check_model("c")
    assert info.value.status == 404 and info.value.param == "model"
    assert [card.id for card in models.list_models().data] == ["a", "b"]


def test_validation_errors_become_openai_400s() -> None:
    from fastapi.exceptions import RequestValidationError

    from pagedllm.entrypoints.openai.errors import error_response, validation_error

    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def handler(_: object, exc: RequestValidationError):  # type: ignore[no-untyped-def]
        return error_response(validation_error(exc))

    @app.post("/c")
    async def create(request: CompletionRequest) -> dict[str, str]:
        return {"ok": "yes"}

    client = TestClient(app)
    cases = [
        ({"prompt": "x", "n": "two"}, "n"),
        ({"prompt": {"a": 1}}, "prompt"),
        ({}, "prompt"),
        ([1, 2], None),
        # Token ids are JSON integers: no booleans or numeric strings slip through as ids.
        ({"prompt": [True, 5]}, "prompt"),
        ({"prompt": [[1, "2"]]}, "prompt"),
        ({"prompt": "x", "stop_token_ids": [False]}, "stop_token_ids"),
    ]
    for body, param in cases:
        response = client.post("/c", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param
        assert error["type"] == "BadRequestError"
        assert "pydantic" not in error["message"]
    assert client.post("/c", json={}).json()["error"]["message"] == "prompt is required"


def test_echo_with_logprobs_asks_for_prompt_logprobs() -> None:
    assert CompletionRequest(prompt="x", echo=True, logprobs=2).to_sampling_params().prompt_logprobs == 2
    assert CompletionRequest(prompt="x", logprobs=2).to_sampling_params().prompt_logprobs is None
    explicit = CompletionRequest(prompt="x", echo=True, logprobs=2, prompt_logprobs=5)
    assert explicit.to_sampling_params().prompt_logprobs == 5


def test_stream_options_need_stream() -> None:
    from pagedllm.entrypoints.openai.serving_utils import check_stream_options

    check_stream_options(CompletionRequest(prompt="x", stream=True, stream_options={"include_usage": True}))
    check_stream_options(CompletionRequest(prompt="x"))
    with pytest.raises(OpenAIError) as info:
        check_stream_options(CompletionRequest(prompt="x", stream_options={"include_usage": True}))
    assert info.value.param == "stream_options"


def test_http_errors_and_hand_validated_bodies_in_openai_shape() -> None:
    import json

    from pydantic import ValidationError
    from starlette.exceptions import HTTPException

    from pagedllm.entrypoints.openai.errors import http_error_response, validation_error
    from pagedllm.entrypoints.openai.protocol_chat import TokenizeChatRequest

    response = http_error_response(HTTPException(405, headers={"Allow": "POST"}))
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert json.loads(response.body)["error"] == {
        "message": "Method Not Allowed",
        "type": "BadRequestError",
        "param": None,
        "code": 405,
    }
    with pytest.raises(ValidationError) as info:
        TokenizeChatRequest.model_validate({"messages": "x"})
    error = validation_error(info.value)
    assert error.param == "messages" and "TokenizeChatRequest" not in error.message


def test_server_chat_template_is_checked_once(tmp_path: Path) -> None:
    from pagedllm.entrypoints.openai.chat_rendering import load_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{{ x }}") == "{{ x }}"
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for %}")
    with pytest.raises(ValueError, match="neither a template nor a file"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_unsupported_vllm_fields_unless_neutral() -> None:
    request = CompletionRequest(
        prompt="x",
        guided_decoding_backend="xgrammar",
        cache_salt="s",
        response_format={"type": "json_object"},
    )
    assert request.unsupported_fields() == ["guided_decoding_backend", "cache_salt"]
    neutral = CompletionRequest(
        prompt="x",
        guided_json=None,
        cache_salt=None,
        thinking_token_budget=-1,
        response_format={"type": "text"},
    )
    assert neutral.unsupported_fields() == []
    # Fields vLLM does not know either are only logged.
    assert CompletionRequest(prompt="x", made_up=1).unsupported_fields() == []


def test_lone_surrogates_are_refused_anywhere_in_the_request() -> None:
    with pytest.raises(ValidationError, match="surrogate"):
        CompletionRequest(prompt=["ok", "\ud800"])
    with pytest.raises(ValidationError, match="surrogate"):
        ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}])
    with pytest.raises(ValidationError, match="surrogate"):
        CompletionRequest(prompt="x", logit_bias={"\ud800": 1.0})


def test_watermarking_extra_param() -> None:
    """vLLM's per-request `watermarking` reaches SamplingParams (None: the engine decides)."""
    assert CompletionRequest(prompt="x").to_sampling_params().watermarking is None
    assert CompletionRequest(prompt="x", watermarking=False).to_sampling_params().watermarking is False
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], watermarking=True)
    assert chat.to_sampling_params().watermarking is True
    assert "watermarking" not in CompletionRequest(prompt="x", watermarking=True).unsupported_fields()
