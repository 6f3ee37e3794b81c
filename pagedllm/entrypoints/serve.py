"""`pagedllm serve [MODEL] [options]`: the OpenAI-compatible server (the embedded SmolLM2 by default)."""

from __future__ import annotations

import argparse
import logging
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pagedllm.config.args import EngineArgs

    parser = subparsers.add_parser(
        "serve",
        help="Start the OpenAI-compatible API server.",
        description="Serve a model over an OpenAI-compatible HTTP API (the embedded SmolLM2-135M-Instruct "
        "unless a model is given).",
    )
    server = parser.add_argument_group("Server")
    server.add_argument(
        "--host", default="127.0.0.1", help="Address to listen on (0.0.0.0 for every interface)."
    )
    server.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    server.add_argument(
        "--api-key",
        default=None,
        help="Require `Authorization: Bearer <key>` on every /v1 route (default: the PAGEDLLM_API_KEY "
        "environment variable, else no key).",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        help="Chat template (a Jinja string or a file path) replacing the tokenizer's.",
    )
    server.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="Log level of uvicorn (the HTTP access log is at info).",
    )
    server.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="Do not log requests even when --enable-log-requests is given.",
    )
    EngineArgs.add_cli_args(parser, model_positional=True)
    return parser


def run(args: argparse.Namespace) -> int:
    from pagedllm.config.args import EngineArgs
    from pagedllm.entrypoints.openai.api_server import main

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        engine_config = EngineArgs.from_cli_args(args).create_engine_config()
    except (ValueError, TypeError) as e:
        # Config errors name the offending option; a traceback would only bury that line.
        print(f"pagedllm serve: error: {e}", file=sys.stderr)
        return 2
    return main(args, engine_config)
