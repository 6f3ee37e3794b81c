"""ASGI middleware of the server: the API key, the request body size limit, and 500s that keep the
connection.

Plain ASGI rather than FastAPI's ``@app.middleware``: that one wraps responses and would get in the way of
streaming and of detecting client disconnects.
"""

from __future__ import annotations

import logging
import secrets
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm import envs
from pagedllm.entrypoints.openai.errors import OpenAIError, error_response

logger = logging.getLogger("pagedllm.entrypoints.openai")

# The only routes open without the key: probes and scrapers, which neither run requests nor change
# state. Every other path needs it, including routes added later and paths that match no route.
OPEN_PATHS = frozenset({"/health", "/version", "/metrics", "/ping", "/load"})


def configured_api_key(flag: str | None) -> str | None:
    """The key a server requires: ``--api-key`` when given, else ``PAGEDLLM_API_KEY``; None (or an empty
    value) means no key."""
    return (flag if flag is not None else envs.PAGEDLLM_API_KEY) or None


class ApiKeyMiddleware:
    """Every route but `OPEN_PATHS` needs ``Authorization: Bearer <key>``."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            # Constant-time comparison: the key must not leak through response timing.
            if not secrets.compare_digest(given, self.expected):
                error = OpenAIError("Invalid or missing API key", HTTPStatus.UNAUTHORIZED)
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    """413 for a request body over ``max_bytes``, decided before the body is read: from Content-Length
    when the client sends one, else by counting the chunks as the app receives them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> OpenAIError:
        return OpenAIError(
            f"The request body is larger than this server's limit of {self.max_bytes} bytes "
            "(--max-request-body-bytes)",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._error(), headers={"Connection": "close"})(scope, receive, send)
            return
        received = 0
        too_large = False
        started = False

        async def counting_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            # Whatever the app makes of a body it could not read (FastAPI turns the error into a 400) is
            # replaced by the 413 below.
            if too_large:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not too_large:
                raise
        if too_large and not started:
            await error_response(self._error(), headers={"Connection": "close"})(scope, receive, send)


class InternalErrorMiddleware:
    """An exception no handler took becomes a 500 in OpenAI's shape, and the keep-alive connection stays
    open. (Starlette's handler for `Exception` answers too, but re-raises the exception to the server,
    and uvicorn then closes the connection: every client request on it after a 500 failed.) Only a
    response already under way is left to the server to cut off: it cannot be completed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            logger.exception("Internal error answering %s %s", scope["method"], scope["path"])
            error = OpenAIError(
                f"Internal server error: {type(exc).__name__}: {exc}", HTTPStatus.INTERNAL_SERVER_ERROR
            )
            await error_response(error)(scope, receive, send)
