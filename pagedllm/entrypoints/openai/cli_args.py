"""vLLM's front-end flags of `vllm serve` that `pagedllm serve` takes too, and the options they resolve to.

Each flag is implemented, or (only where it can change nothing observable in this design) accepted as a
documented no-op, so that an existing vLLM launch command starts; any other value of such a flag is
refused at start-up naming it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from pagedllm.config.arg_parser import parse_json_object


@dataclass(frozen=True)
class FrontendOptions:
    """What the front-end flags ask of the request handlers."""

    # usage.prompt_tokens_details.cached_tokens: the prompt's tokens found in the prefix cache.
    enable_prompt_tokens_details: bool = False
    # Logprob tokens as "token_id:<id>" strings (a request's return_tokens_as_token_ids overrides it).
    return_tokens_as_token_ids: bool = False
    # Usage in every response, streams included, whatever stream_options say.
    enable_force_include_usage: bool = False
    # The role of the generated message when the request adds the generation prompt.
    response_role: str = "assistant"
    # Chat template kwargs every request starts from (its own chat_template_kwargs win).
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FrontendOptions:
        return cls(
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            enable_force_include_usage=args.enable_force_include_usage,
            response_role=args.response_role,
            default_chat_template_kwargs=dict(args.default_chat_template_kwargs or {}),
        )


def _one_api_server(text: str) -> int:
    count = int(text)
    if count != 1:
        # Several API server processes would share the engine over ZMQ: not built here.
        raise argparse.ArgumentTypeError("only 1 is supported (one API server process per engine)")
    return count


def add_frontend_args(group: argparse._ArgumentGroup) -> None:
    """vLLM's front-end flags (see the module docstring), added to the server's argument group."""
    group.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="Report usage.prompt_tokens_details.cached_tokens (prompt tokens served from the prefix cache).",
    )
    group.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="Count the inference requests in flight and serve the count at GET /load.",
    )
    group.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="Serve GET /tokenizer_info (the tokenizer's configuration, chat template included).",
    )
    group.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="Write logprob tokens as 'token_id:<id>' strings, so that tokens that are not valid UTF-8 on "
        "their own can be identified (a request's return_tokens_as_token_ids overrides it).",
    )
    group.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="Include usage in every response, streams included (as if stream_options.include_usage).",
    )
    group.add_argument(
        "--response-role",
        default="assistant",
        help="The role of the generated chat message when the request adds the generation prompt.",
    )
    group.add_argument(
        "--default-chat-template-kwargs",
        type=parse_json_object,
        default=None,
        help="Chat template kwargs (a JSON object) every request starts from; a request's own "
        "chat_template_kwargs take precedence. Example: '{\"enable_thinking\": false}'.",
    )
    group.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="Answer every request with an X-Request-Id header (the client's, else a new id).",
    )
    group.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="Turn uvicorn's access log off."
    )
    group.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="Do not serve FastAPI's OpenAPI schema, Swagger UI or ReDoc (/openapi.json, /docs, /redoc).",
    )
    group.add_argument("--root-path", default=None, help="FastAPI root_path, behind a path-routing proxy.")
    group.add_argument("--ssl-keyfile", default=None, help="The TLS key file (serve HTTPS).")
    group.add_argument("--ssl-certfile", default=None, help="The TLS certificate file (serve HTTPS).")
    group.add_argument(
        "--ssl-ca-certs", default=None, help="The CA certificates file for client certificates."
    )
    group.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="Whether a client certificate is required (the stdlib ssl module's CERT_* value).",
    )
    group.add_argument(
        "--uds", default=None, help="Listen on this Unix domain socket instead of --host/--port."
    )
    # Documented no-ops: in this design they cannot change anything a client or operator observes.
    group.add_argument(
        "--disable-frontend-multiprocessing",
        action="store_true",
        help="Accepted for vLLM compatibility; no effect: the API server and its engine client already "
        "share one process (the engine core always runs in its own, as in vLLM V1).",
    )
    group.add_argument(
        "--api-server-count",
        "-asc",
        type=_one_api_server,
        default=1,
        help="Accepted for vLLM compatibility with the value 1 (one API server process), the only one.",
    )
