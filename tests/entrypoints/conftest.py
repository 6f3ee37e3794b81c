"""Fixtures of the server tests: a real `pagedllm serve` process per test module."""

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
