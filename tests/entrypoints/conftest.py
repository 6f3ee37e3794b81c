"""Fixtures of the server tests: a real `pagedllm serve` process per test module."""

from __future__ import annotations

from collections.abc import Iterator

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
