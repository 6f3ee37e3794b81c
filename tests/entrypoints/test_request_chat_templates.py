"""Chat templates sent in requests on a server that accepts them (`--trust-request-chat-template`, the
session's tool server): template text, never a path; a template that allocates without bound or loops
for minutes is a 400 naming chat_template, while /health keeps answering and the server stays small.
(Without the flag they are refused: test_server_hardening.py.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
from remote_server import MODEL_NAME, RemoteServer

from pagedllm.entrypoints.openai.template_sandbox import TIMEOUT_S

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Hi"}]
ENDLESS_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def http(tool_server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tool_server.url, timeout=120) as client:
        yield client


def _rendered(http: httpx.Client, template: str) -> str:
    response = http.post(
        "/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES, "chat_template": template}
    )
    assert response.status_code == 200, response.text
    tokens = response.json()["tokens"]
    return http.post("/detokenize", json={"model": MODEL_NAME, "tokens": tokens}).json()["prompt"]


def _refused(http: httpx.Client, template: str) -> str:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1, "chat_template": template}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template", error
    return str(error["message"])


def test_a_request_template_is_text_never_a_path(http: httpx.Client) -> None:
    assert _rendered(http, "[{{ messages[0].content }}]") == "[Hi]"
    assert _rendered(http, "/etc/passwd") == "/etc/passwd"
    assert "sandbox" in _refused(http, "{{ ().__class__.__base__.__subclasses__() }}")


def test_hostile_templates_are_stopped_and_the_server_keeps_serving(
    http: httpx.Client, tool_server: RemoteServer
) -> None:
    _rendered(http, "ready")  # the sandbox process is up
    server = psutil.Process(tool_server.proc.pid)
    rss = server.memory_info().rss
    health_waits: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            start = time.monotonic()
            assert httpx.get(f"{tool_server.url}/health", timeout=30).status_code == 200
            health_waits.append(time.monotonic() - start)
            time.sleep(0.2)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        start = time.monotonic()
        assert f"longer than {TIMEOUT_S:g} s" in _refused(http, ENDLESS_LOOPS)
        assert time.monotonic() - start < TIMEOUT_S + 5
        _refused(http, "{{'x'*200000000}}")  # the 70-byte request that OOM-killed a server
    finally:
        done.set()
        prober.join()
    # The event loop never waited for a template (2 s: a loaded 2-core machine).
    assert health_waits and max(health_waits) < 2.0, health_waits
    assert server.memory_info().rss - rss < 200 * 2**20
    assert _rendered(http, "{{ messages[0].content }}!") == "Hi!"
