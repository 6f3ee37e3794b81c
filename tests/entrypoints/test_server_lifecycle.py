"""Server processes under stress: API keys, a killed engine core, a SIGTERM drain, no orphans."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest
from remote_server import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow


def test_api_key_then_engine_killed() -> None:
    server = RemoteServer(extra_args=["--served-model-name", "smol"], env={"PAGEDLLM_API_KEY": "sekrit"})
    try:
        # API key on: /v1 needs it, /health does not.
        wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == 401
        assert httpx.get(f"{server.url}/health").status_code == 200
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekrit", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["smol"]
        assert client.completions.create(model="smol", prompt="Hi", max_tokens=1).model == "smol"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1)
        assert 'model_name="smol"' in httpx.get(f"{server.url}/metrics").text

        # A long stream in flight when the engine core is killed: it ends with an error, no hang.
        outcome: dict[str, object] = {}

        def stream_long() -> None:
            try:
                stream = client.completions.create(
                    model="smol", prompt="Count:", max_tokens=400, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                for _ in stream:
                    outcome["chunks"] = int(outcome.get("chunks", 0)) + 1  # type: ignore[call-overload]
                outcome["ended"] = "normally"
            except Exception as e:  # the stream breaks off with an error event
                outcome["ended"] = repr(e)

        thread = threading.Thread(target=stream_long)
        thread.start()
        deadline = time.monotonic() + 60
        while not outcome.get("chunks") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert outcome.get("chunks"), server.log_tail()
        server.engine_process().kill()
        thread.join(30)
        assert not thread.is_alive(), "the stream hung after the engine died"
        assert outcome["ended"] != "normally"
        assert "engine" in str(outcome["ended"]).lower()

        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="smol", prompt="hello", max_tokens=2)
        assert info.value.status_code == 503
        # The server stays up and answers (no hang), then exits cleanly on SIGTERM.
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
        assert server.leftover_children() == []
    finally:
        server.kill()


def test_sigterm_drains_requests_in_flight() -> None:
    server = RemoteServer(extra_args=["--shutdown-timeout", "120"])
    try:
        result: dict[str, object] = {}

        def long_request() -> None:
            body = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": 16, "ignore_eos": True}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            result["status"] = response.status_code
            result["body"] = response.json()

        thread = threading.Thread(target=long_request)
        thread.start()
        # Wait until the engine runs it, then ask the server to stop.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
            if f'pagedllm:num_requests_running{{model_name="{MODEL_NAME}"}} 1.0' in metrics:
                break
            time.sleep(0.05)
        server.send_signal(signal.SIGTERM)
        thread.join(180)
        assert result.get("status") == 200, (result, server.log_tail())
        assert result["body"]["usage"]["completion_tokens"] == 16  # type: ignore[index]
        assert server.wait(60) == 0
        assert server.leftover_children() == []
    finally:
        server.kill()
