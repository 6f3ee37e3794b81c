"""Fixtures of the server tests: a real `pagedllm serve` process per test module, or one shared by the
modules whose tests leave it as they found it (a server start is ~10-30 s of imports on 2 cores)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from remote_server import RemoteServer


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    # A short stats interval so that a test sees the periodic log line (10 s by default).
    remote = RemoteServer(extra_args=["--log-stats-interval", "1"])
    try:
        yield remote
    finally:
        remote.kill()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    """The official client on the module's server (a module may override `server` with its own flags)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tool_server() -> Iterator[RemoteServer]:
    """The default model with tool calling on (`--enable-auto-tool-choice --tool-call-parser hermes`),
    for the tool-call and the structured-output tests, and with `--trust-request-chat-template` for the
    request-template tests: requests without `tools` or a `chat_template` are served exactly as without
    the flags, and no module stops the server or reads its counters."""
    remote = RemoteServer(
        extra_args=[
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--trust-request-chat-template",
        ]
    )
    try:
        yield remote
    finally:
        remote.kill()


@pytest.fixture(scope="session")
def vllm_flags_server() -> Iterator[RemoteServer]:
    """The default model started with vLLM's front-end flags, shared by the modules that pin vLLM's wire
    behaviour and the clients nobody here wrote (their requests leave the server as they found it)."""
    remote = RemoteServer(extra_args=VLLM_FRONTEND_FLAGS)
    try:
        yield remote
    finally:
        remote.kill()


# vLLM's front-end flags the shared server starts with (as a vLLM launch command gives them).
VLLM_FRONTEND_FLAGS = [
    "--disable-frontend-multiprocessing",
    "--enable-prompt-tokens-details",
    "--enable-server-load-tracking",
    "--enable-tokenizer-info-endpoint",
    "--return-tokens-as-token-ids",
    "--enable-request-id-headers",
    "--api-server-count",
    "1",
    "--default-chat-template-kwargs",
    '{"greeting": "Ahoy"}',
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    # The conformance tests send their own templates (custom roles, template kwargs).
    "--trust-request-chat-template",
]
