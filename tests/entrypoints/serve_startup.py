"""`pagedllm serve`'s parser and start-up run in-process up to the engine's creation, which fails the
test: for the checks that must refuse a bad flag before any model is loaded (an interpreter start-up per
case would cost ~10 s)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from remote_server import SERVER_ARGS

from pagedllm.config.args import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints import cli
from pagedllm.entrypoints.openai.api_server import run_server


def refused_before_the_engine(
    flags: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> str:
    """The error log of `pagedllm serve <flags>`, which must return status 2 without creating the engine."""
    parser, _ = cli.build_parser("serve")
    args = parser.parse_args(["serve", *SERVER_ARGS, *flags])
    engine_config = EngineArgs.from_cli_args(args).create_engine_config()

    def engine_created(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the engine (and the model) was loaded")

    monkeypatch.setattr(AsyncLLM, "create", engine_created)
    with caplog.at_level(logging.ERROR):
        assert asyncio.run(run_server(args, engine_config)) == 2
    return caplog.text
