"""Fixtures of the server tests: a real `pagedllm serve` process per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from remote_server import RemoteServer


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    remote = RemoteServer()
    try:
        yield remote
    finally:
        remote.kill()
