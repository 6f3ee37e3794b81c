"""disagg-proxy's routing with fake instances (httpx mock transport): what the prefill and decode sides
receive, and what happens when the prefill side refuses or fails."""

from __future__ import annotations

import json

import httpx
from fastapi.testclient import TestClient

from pagedllm.entrypoints.disagg_proxy import build_app, prefill_body


def _proxy(prefill_status: int | None) -> tuple[TestClient, list[tuple[str, dict]]]:
    seen: list[tuple[str, dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.host, body))
        if request.url.host == "prefill":
            if prefill_status is None:
                raise httpx.ConnectError("refused")
            return httpx.Response(prefill_status, json={"error": {"message": "bad"}})
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})

    app = build_app(["http://prefill"], ["http://decode"], 5.0, httpx.MockTransport(handler))
    return TestClient(app), seen


def test_prefill_gets_one_token_then_decode_gets_the_request() -> None:
    client, seen = _proxy(200)
    body = {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": False, "min_tokens": 2, "n": 2}
    out = client.post("/v1/completions", json=body)
    assert out.status_code == 200 and out.json()["choices"][0]["text"] == "decoded"
    assert seen == [("prefill", prefill_body(body)), ("decode", body)]
    assert seen[0][1] == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "n": 1}


def test_failing_prefill_falls_back_to_decode_and_bad_requests_are_answered() -> None:
    for status in (None, 500):  # unreachable, server error: the decode side computes the prompt
        client, seen = _proxy(status)
        out = client.post("/v1/chat/completions", json={"messages": [], "max_completion_tokens": 3})
        assert out.status_code == 200 and [host for host, _ in seen] == ["prefill", "decode"]
    client, seen = _proxy(400)
    out = client.post("/v1/completions", json={"prompt": "x"})
    assert out.status_code == 400 and [host for host, _ in seen] == ["prefill"]
    assert client.post("/v1/completions", content=b"{not json").status_code == 400
