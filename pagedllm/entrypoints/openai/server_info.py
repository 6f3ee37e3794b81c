"""vLLM's optional server routes and headers: GET /load (--enable-server-load-tracking), GET
/tokenizer_info (--enable-tokenizer-info-endpoint) and X-Request-Id on responses
(--enable-request-id-headers)."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Routes that run requests on the engine: what the server load counts.
INFERENCE_PREFIXES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
    "/invocations",
)


class ServerLoad:
    """The number of inference requests in flight, each counted from its arrival until its response (a
    stream included) is sent in full, as vLLM's server_load_metrics."""

    def __init__(self) -> None:
        self.in_flight = 0


class ServerLoadMiddleware:
    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or not scope["path"].startswith(INFERENCE_PREFIXES)
        ):
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1


class RequestIdHeaderMiddleware:
    """Every response carries X-Request-Id: the client's own, else a new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id")
        request_id = given if given else uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def add_load_route(app: FastAPI, load: ServerLoad) -> None:
    app.add_middleware(ServerLoadMiddleware, load=load)

    @app.get("/load")
    async def server_load() -> JSONResponse:
        return JSONResponse({"server_load": load.in_flight})


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """The tokenizer's configuration as tokenizer_config.json holds it (vLLM's /tokenizer_info): its
    constructor arguments made JSON, its class, and the chat template the server renders with."""
    info: dict[str, Any] = {
        key: _jsonable(value)
        for key, value in dict(getattr(tokenizer, "init_kwargs", {})).items()
        # Paths on the server's disk and loaded objects say nothing about the tokenizer itself.
        if not key.endswith("_file") and key not in ("name_or_path", "tokenizer_object")
    }
    info["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template is not None:
        info["chat_template"] = template
    return info


def _jsonable(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_jsonable(v) for v in value]
    # AddedToken and the like: their text.
    return str(getattr(value, "content", value))


def add_tokenizer_info_route(app: FastAPI, tokenizer: Any, chat_template: str | None) -> None:
    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> JSONResponse:
        return JSONResponse(tokenizer_info(tokenizer, chat_template))
