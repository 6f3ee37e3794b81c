"""vLLM's request semantics over HTTP: refused fields name themselves, prompt truncation, request ids,
chat roles (one server shared with the other vLLM-conformance modules)."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from remote_server import RemoteServer

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def _post(server: RemoteServer, route: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json=body, timeout=120)


def _ok(response: httpx.Response) -> dict[str, object]:
    assert response.status_code == 200, response.text
    return response.json()


def _bad(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def _tokenize(server: RemoteServer, **body: object) -> list[int]:
    return _ok(_post(server, "/tokenize", body))["tokens"]  # type: ignore[return-value]


# ------------------------------------------------------------------------- fields that would do nothing
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("priority", 1),  # the server schedules first come, first served
        ("cache_salt", "s3cret"),
        ("thinking_token_budget", 10),
        ("logprob_token_ids", [5]),
        ("repetition_detection", {"max_pattern_size": 4}),
        ("session_id", "abc"),
        ("stream_interval", 4),
    ],
)
def test_fields_without_effect_are_refused_by_name(
    vllm_flags_server: RemoteServer, route: str, field: str, value: object
) -> None:
    body: dict[str, object] = {"max_tokens": 2, field: value}
    body.update({"prompt": PROMPT} if route == "/v1/completions" else {"messages": MESSAGES})
    _bad(_post(vllm_flags_server, route, body), field)
    # The values that ask for nothing are taken (clients send defaults explicitly).
    neutral = {"priority": 0, "thinking_token_budget": -1, "stream_interval": 1}
    if field in neutral:
        _ok(_post(vllm_flags_server, route, {**body, field: neutral[field]}))


# ----------------------------------------------------------------------------------- prompt truncation
def test_truncate_prompt_tokens_keeps_the_prompts_end(vllm_flags_server: RemoteServer) -> None:
    ids = list(range(1000, 1600))  # 600 tokens: more than the 512-token context
    body = {"prompt": ids, "max_tokens": 1, "echo": True, "temperature": 0, "truncate_prompt_tokens": 100}
    response = _ok(_post(vllm_flags_server, "/v1/completions", body))
    assert response["usage"]["prompt_tokens"] == 100  # type: ignore[index]
    echoed = response["choices"][0]["text"]  # type: ignore[index]
    kept = _ok(_post(vllm_flags_server, "/detokenize", {"tokens": ids[-100:]}))["prompt"]
    assert echoed.startswith(kept)  # type: ignore[union-attr]
    right = _ok(_post(vllm_flags_server, "/v1/completions", {**body, "truncation_side": "right"}))
    first = _ok(_post(vllm_flags_server, "/detokenize", {"tokens": ids[:100]}))["prompt"]
    assert right["choices"][0]["text"].startswith(first)  # type: ignore[index]
    # A text prompt longer than the context is cut the same way.
    text = "word " * 2000
    response = _ok(
        _post(
            vllm_flags_server,
            "/v1/completions",
            {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 50},
        )
    )
    assert response["usage"]["prompt_tokens"] == 50  # type: ignore[index]
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 1, "truncate_prompt_tokens": 60}
    assert _ok(_post(vllm_flags_server, "/v1/chat/completions", chat))["usage"]["prompt_tokens"] == 60  # type: ignore[index]
    too_many = {"prompt": PROMPT, "max_tokens": 1, "truncate_prompt_tokens": 513}
    assert "512" in _bad(_post(vllm_flags_server, "/v1/completions", too_many), "truncate_prompt_tokens")


# ----------------------------------------------------------------------------------------- request ids
def test_request_id_names_the_response(vllm_flags_server: RemoteServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "request_id": "my-trace-7"}

    def complete(_: int) -> str:
        return _ok(_post(vllm_flags_server, "/v1/completions", body))["id"]  # type: ignore[return-value]

    # Two requests in flight under one id both run (the engine's own ids stay unique).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(complete, range(2))) == ["cmpl-my-trace-7", "cmpl-my-trace-7"]
    chat = {"messages": MESSAGES, "max_tokens": 2, "request_id": "abc"}
    assert _ok(_post(vllm_flags_server, "/v1/chat/completions", chat))["id"] == "chatcmpl-abc"


# ---------------------------------------------------------------------------------------------- roles
def test_developer_role_is_the_system_prompt_of_a_template_without_it(
    vllm_flags_server: RemoteServer,
) -> None:
    def conversation(role: str) -> list[dict[str, str]]:
        return [{"role": role, "content": "Answer in French."}, *MESSAGES]

    developer = _tokenize(vllm_flags_server, messages=conversation("developer"))
    assert developer == _tokenize(vllm_flags_server, messages=conversation("system"))
    reply = _ok(
        _post(
            vllm_flags_server,
            "/v1/chat/completions",
            {"max_tokens": 2, "messages": conversation("developer")},
        )
    )
    assert reply["usage"]["prompt_tokens"] == len(developer)  # type: ignore[index]


def test_custom_roles_reach_the_chat_template(vllm_flags_server: RemoteServer) -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    messages = [{"role": "narrator", "content": "Once"}, {"role": "user", "content": "upon"}]
    tokens = _tokenize(vllm_flags_server, messages=messages, chat_template=template)
    text = _ok(_post(vllm_flags_server, "/detokenize", {"tokens": tokens}))["prompt"]
    assert text == "<narrator>Once<user>upon"
    body = {"messages": messages, "chat_template": template, "max_tokens": 2}
    _ok(_post(vllm_flags_server, "/v1/chat/completions", body))
