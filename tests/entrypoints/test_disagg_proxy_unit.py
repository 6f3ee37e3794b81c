"""disagg-proxy's routing with fake instances (httpx mock transport): what the prefill and decode sides
receive, and what happens when the prefill side refuses or fails."""

from __future__ import annotations

import json

import httpx
from fastapi.testclient import TestClient

from pagedllm.entrypoints.disagg_proxy import build_app, prefill_body


def _proxy(
    prefill_status: int | None, **keys: str
) -> tuple[TestClient, list[tuple[str, dict]], list[str | None]]:
    seen: list[tuple[str, dict]] = []
    authorizations: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        authorizations.append(request.headers.get("authorization"))
        if request.method == "GET":
            return httpx.Response(200, json={"data": []})
        body = json.loads(request.content)
        seen.append((request.url.host, body))
        if request.url.host == "prefill":
            if prefill_status is None:
                raise httpx.ConnectError("refused")
            return httpx.Response(prefill_status, json={"error": {"message": "bad"}})
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})

    app = build_app(["http://prefill"], ["http://decode"], 5.0, httpx.MockTransport(handler), **keys)
    return TestClient(app), seen, authorizations


def test_prefill_gets_one_token_then_decode_gets_the_request() -> None:
    client, seen, _ = _proxy(200)
    body = {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": False, "min_tokens": 2, "n": 2}
    out = client.post("/v1/completions", json=body)
    assert out.status_code == 200 and out.json()["choices"][0]["text"] == "decoded"
    assert seen == [("prefill", prefill_body(body)), ("decode", body)]
    assert seen[0][1] == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "n": 1}


def test_failing_prefill_falls_back_to_decode_and_bad_requests_are_answered() -> None:
    for status in (None, 500):  # unreachable, server error: the decode side computes the prompt
        client, seen, _ = _proxy(status)
        out = client.post("/v1/chat/completions", json={"messages": [], "max_completion_tokens": 3})
        assert out.status_code == 200 and [host for host, _ in seen] == ["prefill", "decode"]
    client, seen, _ = _proxy(400)
    out = client.post("/v1/completions", json={"prompt": "x"})
    assert out.status_code == 400 and [host for host, _ in seen] == ["prefill"]
    assert client.post("/v1/completions", content=b"{not json").status_code == 400


def test_api_key_is_required_and_the_upstream_key_is_sent() -> None:
    client, seen, authorizations = _proxy(200, api_key="sesame", upstream_api_key="inner")
    body = {"model": "m", "prompt": "hi"}
    routes = (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
        for method, path in routes:
            out = client.request(method, path, json=body if method == "POST" else None, headers=headers)
            assert out.status_code == 401, (headers, path)
            error = out.json()["error"]
            assert error["code"] == 401 and "API key" in error["message"]
    assert seen == [] and authorizations == []  # nothing reached the instances
    assert client.get("/health").status_code == 200  # probes stay open, as on `pagedllm serve`
    ok = {"Authorization": "Bearer sesame"}
    assert client.post("/v1/completions", json=body, headers=ok).status_code == 200
    assert client.get("/v1/models", headers=ok).status_code == 200
    # The health probes above are open upstream too; every request the instances got carried their key.
    assert [a for a in authorizations if a is not None] == ["Bearer inner"] * 3


def test_the_proxy_key_goes_upstream_when_no_other_is_given() -> None:
    client, _, authorizations = _proxy(200, api_key="sesame")
    out = client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer sesame"})
    assert out.status_code == 200 and authorizations == ["Bearer sesame"] * 2
