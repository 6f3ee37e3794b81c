"""The server's ASGI middleware under a real uvicorn (no model): a route failing with an unexpected
exception answers 500 in OpenAI's shape and the keep-alive connection serves the next request."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI
from remote_server import free_port

from pagedllm.entrypoints.openai.middleware import InternalErrorMiddleware


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    app = FastAPI()

    @app.get("/boom")
    async def boom() -> None:
        raise KeyError("no such thing")

    @app.get("/ok")
    async def ok() -> dict[str, bool]:
        return {"ok": True}

    app.add_middleware(InternalErrorMiddleware)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


def test_500_keeps_the_connection(port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/boom")
        response = conn.getresponse()
        body = json.loads(response.read())
        assert response.status == 500 and not response.will_close
        assert body["error"]["code"] == 500 and body["error"]["type"] == "InternalServerError"
        assert "KeyError" in body["error"]["message"]
        # The same connection (http.client never reconnects by itself) serves the next request.
        conn.request("GET", "/ok")
        assert conn.getresponse().status == 200
    finally:
        conn.close()
