"""The OpenAI-compatible HTTP server: FastAPI routes over an `AsyncLLM`, run by uvicorn.

Shutdown (SIGTERM/SIGINT): uvicorn stops accepting connections and waits up to `shutdown_timeout`
seconds for the requests in flight; then it cancels the rest (which aborts them in the engine), the
engine core process is stopped, and the process exits with status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
from collections.abc import AsyncIterator, Awaitable
from http import HTTPStatus
from typing import TYPE_CHECKING, Annotated, Any

import uvicorn
from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import pagedllm
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_client import EngineCoreProcess, EngineDeadError
from pagedllm.entrypoints.openai.errors import (
    OpenAIError,
    error_response,
    http_error_response,
    validation_error,
)
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, load_chat_template
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger("pagedllm.entrypoints.openai")


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run a non-streaming handler, cancelling it (and so aborting its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            # Nobody is listening; the status is for the access log.
            return Response(status_code=499)
        return task.result()
    finally:
        watcher.cancel()
        task.cancel()


class ApiKeyMiddleware:
    """Every /v1 route needs ``Authorization: Bearer <key>``.

    Plain ASGI rather than FastAPI's ``@app.middleware``: that one wraps responses and would get in the
    way of streaming and of detecting client disconnects."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            # Constant-time comparison: the key must not leak through response timing.
            if not secrets.compare_digest(given, self.expected):
                error = OpenAIError("Invalid or missing API key", HTTPStatus.UNAUTHORIZED)
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _streaming(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str],
    api_key: str | None,
    chat_template: str | None,
    log_requests: bool,
) -> FastAPI:
    app = FastAPI(title="pagedllm OpenAI-compatible server", version=pagedllm.__version__)
    models = OpenAIServingModels(served_model_names, str(engine.model_config.model), engine.max_model_len)
    completions = OpenAIServingCompletion(engine, models, log_requests)
    chat = OpenAIServingChat(engine, models, chat_template, log_requests)
    tokenization = OpenAIServingTokenization(engine, models, chat_template)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_error_response(exc)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback after this; the client gets the error in OpenAI's shape.
        message = f"Internal server error: {type(exc).__name__}: {exc}"
        return error_response(OpenAIError(message, HTTPStatus.INTERNAL_SERVER_ERROR))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(
            OpenAIError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE, err_type="EngineDeadError")
        )

    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except EngineDeadError as e:
            return error_response(
                OpenAIError(str(e), HTTPStatus.SERVICE_UNAVAILABLE, err_type="EngineDeadError")
            )
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": pagedllm.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.prometheus.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(models.list_models().model_dump())

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw: Request) -> Any:
        return await _respond(raw, completions.create(request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Any:
        return await _respond(raw, chat.create(request))

    @app.post("/tokenize")
    async def tokenize(body: Annotated[dict[str, Any], Body()]) -> JSONResponse:
        # The body's keys pick the schema: validating against a union would report errors under the
        # model classes' names instead of the request's fields.
        schema = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        try:
            request = schema.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from e
        return JSONResponse(tokenization.tokenize(request).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(tokenization.detokenize(request).model_dump())

    return app


async def _respond(raw: Request, work: Awaitable[Any]) -> Any:
    result = await _cancel_on_disconnect(raw, work)
    if isinstance(result, Response):
        return result
    if hasattr(result, "model_dump"):
        return JSONResponse(result.model_dump())
    # A stream: StreamingResponse cancels the generator when the client disconnects, and the
    # generator's clean-up aborts the engine requests.
    return _streaming(result)


def served_names(model_served_name: str | list[str] | None, model: str) -> list[str]:
    names = model_served_name if model_served_name is not None else model
    return [names] if isinstance(names, str) else list(names)


async def run_server(
    args: argparse.Namespace, engine_config: EngineConfig, core_process: EngineCoreProcess | None = None
) -> int:
    """Serve until SIGTERM/SIGINT; ``args`` holds the server flags of `pagedllm serve`, ``core_process``
    an engine core process started early (else one is started here)."""
    model_config = engine_config.model_config
    names = served_names(model_config.served_model_name, str(model_config.model))
    log_requests = engine_config.logging_config.enable_log_requests and not args.disable_log_requests
    api_key = args.api_key if args.api_key is not None else os.environ.get("PAGEDLLM_API_KEY")
    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = load_chat_template(args.chat_template)
        except ValueError as e:
            # Before the engine starts: a bad flag should not cost a model load.
            logger.error("%s", e)
            return 2

    engine = await AsyncLLM.create(
        engine_config,
        names[0],
        log_stats=not engine_config.logging_config.disable_log_stats,
        core_process=core_process,
    )
    try:
        app = build_app(engine, names, api_key or None, chat_template, log_requests)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=engine_config.shutdown_timeout,
            # Keep-alive connections must not hold the drain open.
            timeout_keep_alive=5,
        )
        server = uvicorn.Server(config)
        logger.info("Serving %s on http://%s:%d", ", ".join(names), args.host, args.port)

        def _stop(signum: int, frame: Any) -> None:
            # A signal between start-up and uvicorn installing its own handlers must still stop the
            # server (serve() then exits at once); uvicorn also re-raises the signal it handled after
            # draining, which lands here too and is then harmless.
            server.should_exit = True

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        await server.serve()
    finally:
        await engine.shutdown()
    return 0
