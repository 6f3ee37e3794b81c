"""`pagedllm serve [MODEL] [options]`: the OpenAI-compatible server (the embedded SmolLM2 by default)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import TYPE_CHECKING

from pagedllm.errors import ModelLoadError

if TYPE_CHECKING:
    from pagedllm.engine.core_client import EngineCoreProcess

# The largest legitimate body is a batch of prompts filling the context: 128k tokens of text are ~0.5 MB
# (~3 MB if every character is a JSON \u escape), as token ids ~1 MB. 32 MiB leaves room for several such
# prompts while keeping one request from holding hundreds of megabytes of the server's memory.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
# vLLM's max_n_sequences (VLLM_MAX_N_SEQUENCES), with a default sized for a CPU server's batch.
DEFAULT_MAX_N_SEQUENCES = 128


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pagedllm.config.args import EngineArgs
    from pagedllm.entrypoints.openai.cli_args import add_frontend_args

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
        help="Require `Authorization: Bearer <key>` on every route but /health, /version and /metrics "
        "(default: the PAGEDLLM_API_KEY environment variable, else no key).",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        help="Chat template (a Jinja string or a file path) replacing the tokenizer's.",
    )
    server.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Accept a chat_template in chat and /tokenize requests (refused with a 400 otherwise). It is "
        "template text, never a file path, rendered in a sandboxed process bounded in time and memory.",
    )
    server.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="Largest request body accepted, in bytes; larger ones get 413 before they are read.",
    )
    server.add_argument(
        "--max-n-sequences",
        type=int,
        default=DEFAULT_MAX_N_SEQUENCES,
        help="Largest `n` (choices per prompt) a request may ask for; more is a 400.",
    )
    server.add_argument(
        "--request-limit",
        nargs="+",
        default=None,
        metavar="NAME=N",
        help="Raise (or lower) a bound on a request field's size, e.g. `messages=4096`; the names and "
        "defaults are listed in the README (prompt, messages, tools, tool_bytes, stop, stop_chars, "
        "stop_token_ids, logit_bias, allowed_token_ids, bad_words, input).",
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser.',
    )
    server.add_argument(
        "--tool-call-parser",
        default=None,
        help="How the model writes tool calls: hermes, qwen3_coder (qwen3_xml), llama3_json, mistral, "
        "granite, jamba, internlm, deepseek_v3 (deepseek_v31), pythonic, openai (gpt-oss harmony), or a "
        "name a --tool-parser-plugin registers.",
    )
    server.add_argument(
        "--tool-parser-plugin",
        default=None,
        help="A Python file that registers tool parsers with ToolParserManager.register_module.",
    )
    server.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served under their own model names (needs --enable-lora): name=path, or "
        'JSON \'{"name": ..., "path": ..., "base_model_name": ...}\'.',
    )
    server.add_argument(
        "--allow-dev-mode-remote",
        action="store_true",
        help="Let a server in dev mode (PAGEDLLM_SERVER_DEV_MODE=1: weight updates, worker calls, sleep) "
        "listen on a --host other than loopback; without it such a server refuses to start.",
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
    add_frontend_args(server)
    EngineArgs.add_cli_args(parser, model_positional=True)
    return parser


# Stop signals that arrived before `run` took over (while the CLI parsed the flags).
_early_signals: list[int] = []


def _record_signal(signum: int, frame: object) -> None:
    _early_signals.append(signum)


def _interrupt_startup(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def start_early() -> EngineCoreProcess:
    """The engine core process, started before the CLI parses the flags: its imports (several seconds)
    overlap with the API server's imports and the configuration."""
    from pagedllm.engine.core_client import EngineCoreProcess

    # Parsing takes a moment: a stop signal meanwhile is acted on when `run` starts, not by dying with
    # an engine process half started.
    signal.signal(signal.SIGTERM, _record_signal)
    signal.signal(signal.SIGINT, _record_signal)
    return EngineCoreProcess()


def run(args: argparse.Namespace) -> int:
    core_process: EngineCoreProcess = getattr(args, "started_early", None) or start_early()
    # A signal during start-up aborts it (the engine process is cleaned up); once uvicorn runs, the
    # server's own handlers drain and stop it.
    signal.signal(signal.SIGTERM, _interrupt_startup)
    signal.signal(signal.SIGINT, _interrupt_startup)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        if _early_signals:
            raise KeyboardInterrupt
        from pagedllm.config.args import EngineArgs
        from pagedllm.entrypoints.openai.api_server import run_server
        from pagedllm.entrypoints.startup_errors import report_startup_error

        try:
            engine_config = EngineArgs.from_cli_args(args).create_engine_config()
        except (ValueError, TypeError) as e:
            # Config errors name the offending option or file; a traceback would only bury that line.
            return report_startup_error("serve", e)
        try:
            return asyncio.run(run_server(args, engine_config, core_process))
        except ModelLoadError as e:  # found while the engine core loads the model
            return report_startup_error("serve", e)
    except KeyboardInterrupt:
        logging.getLogger("pagedllm.entrypoints.serve").info("Interrupted during start-up")
        return 0
    finally:
        core_process.stop()
