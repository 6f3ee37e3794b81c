"""The OpenAI-compatible HTTP server: FastAPI routes over an `AsyncLLM`, run by uvicorn.

Shutdown (SIGTERM/SIGINT): uvicorn stops accepting connections and waits up to `shutdown_timeout`
seconds for the requests in flight; then the rest are failed in the engine (each client gets an error:
an SSE error event and [DONE], or a 503), the engine core process is stopped, and the process exits with
status 0. If the engine core dies, the requests in flight fail the same way and the process exits with
status 1, so that a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import signal
import socket
from collections.abc import AsyncIterator, Awaitable
from http import HTTPStatus
from typing import TYPE_CHECKING, Annotated, Any

import uvicorn
from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm import envs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_client import EngineCoreProcess, EngineDeadError
from pagedllm.entrypoints.openai.chat_rendering import ChatPromptRenderer, load_chat_template
from pagedllm.entrypoints.openai.cli_args import FrontendOptions
from pagedllm.entrypoints.openai.dev_routes import register_operation_routes
from pagedllm.entrypoints.openai.errors import (
    OpenAIError,
    error_response,
    http_error_response,
    validation_error,
)
from pagedllm.entrypoints.openai.middleware import (
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    InternalErrorMiddleware,
    configured_api_key,
)
from pagedllm.entrypoints.openai.protocol import (
    CompletionRequest,
    DetokenizeRequest,
    TokenizeCompletionRequest,
)
from pagedllm.entrypoints.openai.protocol_chat import ChatCompletionRequest, TokenizeChatRequest
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedllm.entrypoints.openai.request_limits import RequestLimits, parse_request_limits
from pagedllm.entrypoints.openai.server_info import (
    RequestIdHeaderMiddleware,
    ServerLoad,
    add_load_route,
    add_tokenizer_info_route,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_invocations import Invocation, add_invocations_route
from pagedllm.entrypoints.openai.serving_lora import LoRARegistry, add_lora_routes, parse_lora_module
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling, add_pooling_routes
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.entrypoints.openai.serving_tools import ToolCallingConfig, load_tool_calling_config
from pagedllm.entrypoints.openai.serving_utils import PromptTokenizer
from pagedllm.entrypoints.openai.template_sandbox import TemplateSandbox
from pagedllm.lora.allowed_roots import check_adapter_path
from pagedllm.metrics.tracing import extract_trace_headers

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger("pagedllm.entrypoints.openai")

# After the engine core died: the server fails what is in flight, then exits with this status so that a
# supervisor restarts it.
ENGINE_DEAD_EXIT_CODE = 1


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


def _streaming(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str],
    api_key: str | None,
    chat_template: str | None,
    max_request_body_bytes: int,
    limits: RequestLimits,
    tool_calling: ToolCallingConfig | None = None,
    template_sandbox: TemplateSandbox | None = None,
    args: argparse.Namespace | None = None,
) -> FastAPI:
    """``chat_template``: the operator's template text; ``template_sandbox``: where templates sent in
    requests render (None: they are refused); ``args``: `pagedllm serve`'s flags (vLLM's front-end
    flags among them), None for their defaults."""
    options = FrontendOptions() if args is None else FrontendOptions.from_args(args)
    docs = args is None or not args.disable_fastapi_docs
    app = FastAPI(
        title="pagedllm OpenAI-compatible server",
        version=pagedllm.__version__,
        **({} if docs else {"openapi_url": None, "docs_url": None, "redoc_url": None}),
    )
    lora = LoRARegistry(engine, served_model_names) if engine.engine_config.lora_config is not None else None
    app.state.lora = lora
    models = OpenAIServingModels(
        served_model_names, str(engine.model_config.model), engine.max_model_len, lora
    )
    prompts = PromptTokenizer(engine.tokenizer, engine.max_model_len)
    completions = OpenAIServingCompletion(engine, models, prompts, limits, options)
    chat_renderer = ChatPromptRenderer(
        engine.tokenizer, chat_template, template_sandbox, options.default_chat_template_kwargs
    )
    chat = OpenAIServingChat(engine, models, prompts, chat_renderer, limits, tool_calling, options)
    tokenization = OpenAIServingTokenization(engine, models, prompts, chat_renderer)
    pooling = OpenAIServingPooling(engine, models, prompts, limits)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_error_response(exc)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(
            OpenAIError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE, err_type="EngineDeadError")
        )

    # Added first, so it runs innermost: around the routes and their exception handlers only.
    app.add_middleware(InternalErrorMiddleware)
    if args is not None and args.enable_server_load_tracking:
        add_load_route(app, ServerLoad())
    if args is not None and args.enable_tokenizer_info_endpoint:
        add_tokenizer_info_route(app, engine.tokenizer, chat_template)
    if args is not None and args.enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    # Added last, so it runs first: an oversized body is refused before anything reads it.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)

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

    # As vLLM: a model serves the endpoints of its runner only; the others answer 404.
    if engine.model_config.pooler_config is None:

        @app.post("/v1/completions")
        async def create_completion(request: CompletionRequest, raw: Request) -> Any:
            return await _respond(raw, completions.create(request, extract_trace_headers(raw.headers)))

        @app.post("/v1/chat/completions")
        async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Any:
            return await _respond(raw, chat.create(request, extract_trace_headers(raw.headers)))

        responses = OpenAIServingResponses(chat)

        @app.post("/v1/responses")
        async def create_response(request: ResponsesRequest, raw: Request) -> Any:
            return await _respond(raw, responses.create(request, extract_trace_headers(raw.headers)))

        @app.get("/v1/responses/{response_id}")
        async def retrieve_response(response_id: str) -> JSONResponse:
            return JSONResponse(responses.retrieve(response_id))

        invocations: list[Invocation] = [
            (ChatCompletionRequest, create_chat_completion),
            (CompletionRequest, create_completion),
        ]
    else:
        invocations = add_pooling_routes(app, pooling, _respond)
    add_invocations_route(app, invocations)

    @app.post("/tokenize")
    async def tokenize(body: Annotated[dict[str, Any], Body()]) -> JSONResponse:
        # The body's keys pick the schema: validating against a union would report errors under the
        # model classes' names instead of the request's fields.
        schema = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        try:
            request = schema.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from e
        response = await tokenization.tokenize(request)
        # Serialized off the event loop too: a long prompt's answer lists every token.
        return Response(await asyncio.to_thread(response.model_dump_json), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        return JSONResponse((await tokenization.detokenize(request)).model_dump())

    if lora is not None and envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING:
        add_lora_routes(app, lora)
    # Profiling, and in dev mode sleep mode, weight updates and worker calls.
    register_operation_routes(app, engine)
    return app


async def _respond(raw: Request, work: Awaitable[Any]) -> Any:
    result = await _cancel_on_disconnect(raw, work)
    if isinstance(result, Response):
        return result
    if hasattr(result, "model_dump"):
        return JSONResponse(result.model_dump())
    if isinstance(result, dict):
        return JSONResponse(result)
    # A stream: StreamingResponse cancels the generator when the client disconnects, and the
    # generator's clean-up aborts the engine requests.
    return _streaming(result)


def is_loopback(host: str) -> bool:
    """Whether every address `host` resolves to is a loopback one (0.0.0.0 and :: are every interface)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_dev_mode_host(host: str, allow_remote: bool) -> None:
    """Dev mode's routes change weights and call worker methods: refuse to serve them beyond this machine
    unless the operator says so (ValueError)."""
    if envs.PAGEDLLM_SERVER_DEV_MODE and not allow_remote and not is_loopback(host):
        raise ValueError(
            f"PAGEDLLM_SERVER_DEV_MODE=1 with --host {host}: the dev-mode routes (weight updates, worker "
            "calls, sleep) would be reachable from other machines. Listen on 127.0.0.1, or pass "
            "--allow-dev-mode-remote (and --api-key) to accept that."
        )


def served_names(model_served_name: str | list[str] | None, model: str) -> list[str]:
    names = model_served_name if model_served_name is not None else model
    return [names] if isinstance(names, str) else list(names)


class _Server(uvicorn.Server):
    """uvicorn's server, ending the requests still running when the drain time is up.

    uvicorn itself would cancel their tasks, cutting streams off mid-response; instead every request in
    flight is failed in the engine, so that each client gets an error (an SSE error event and [DONE] for a
    stream, a 503 otherwise), and uvicorn is given a little longer to let the handlers write it."""

    # Time the handlers get to write the errors out, after the drain time.
    WRITE_OUT_S = 5.0

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, drain_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_s = drain_s

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(
            self.drain_s, self.engine.fail_all_requests, "The server is shutting down"
        )
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


async def _stop_when_engine_dies(engine: AsyncLLM, server: uvicorn.Server) -> None:
    # The engine fails the requests in flight itself when its core dies; the server then has nothing left
    # to serve, and a supervisor can only restart it if it exits (as vLLM's server does).
    while not engine.is_dead:
        await asyncio.sleep(0.2)
    logger.error("The engine core died (%s); stopping the server", engine.dead_error)
    server.should_exit = True


async def run_server(
    args: argparse.Namespace, engine_config: EngineConfig, core_process: EngineCoreProcess | None = None
) -> int:
    """Serve until SIGTERM/SIGINT (status 0) or the death of the engine core (`ENGINE_DEAD_EXIT_CODE`);
    ``args`` holds the server flags of `pagedllm serve`, ``core_process`` an engine core process started
    early (else one is started here)."""
    model_config = engine_config.model_config
    names = served_names(model_config.served_model_name, str(model_config.model))
    log_requests = engine_config.logging_config.enable_log_requests and not args.disable_log_requests
    api_key = configured_api_key(args.api_key)
    chat_template = None
    try:
        check_dev_mode_host(args.host, args.allow_dev_mode_remote)
        if args.chat_template is not None:
            chat_template = load_chat_template(args.chat_template)
        tool_calling = load_tool_calling_config(
            args.enable_auto_tool_choice, args.tool_call_parser, args.tool_parser_plugin
        )
        limits = RequestLimits(args.max_n_sequences, parse_request_limits(args.request_limit))
        lora_modules = [parse_lora_module(m) for m in args.lora_modules or ()]
        if lora_modules and engine_config.lora_config is None:
            raise ValueError("--lora-modules needs --enable-lora")
        lora_config = engine_config.lora_config
        for module in lora_modules:  # before the model loads; the workers check every adapter they read
            try:
                check_adapter_path(module.path, lora_config.lora_allowed_roots if lora_config else None)
            except ValueError as e:
                raise ValueError(f"--lora-modules {module.name}: {e}") from None
    except ValueError as e:
        # Before the engine starts: a bad flag should not cost a model load.
        logger.error("%s", e)
        return 2

    engine = await AsyncLLM.create(
        engine_config,
        names[0],
        log_stats=not engine_config.logging_config.disable_log_stats,
        core_process=core_process,
        log_requests=log_requests,
    )
    watchdog: asyncio.Task[None] | None = None
    sandbox = TemplateSandbox() if args.trust_request_chat_template else None
    try:
        if sandbox is not None:
            sandbox.start()
        app = build_app(
            engine,
            names,
            api_key,
            chat_template,
            max_request_body_bytes=args.max_request_body_bytes,
            limits=limits,
            tool_calling=tool_calling,
            template_sandbox=sandbox,
            args=args,
        )
        for module in lora_modules:
            try:
                await app.state.lora.load(module)
            except OpenAIError as e:
                logger.error("--lora-modules %s: %s", module.name, e.message)
                return 2
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            uds=args.uds,
            root_path=args.root_path or "",
            access_log=not args.disable_uvicorn_access_log,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=engine_config.shutdown_timeout + _Server.WRITE_OUT_S,
            # Keep-alive connections must not hold the drain open.
            timeout_keep_alive=5,
        )
        server = _Server(config, engine, engine_config.shutdown_timeout)
        logger.info("Serving %s on http://%s:%d", ", ".join(names), args.host, args.port)

        def _stop(signum: int, frame: Any) -> None:
            # A signal between start-up and uvicorn installing its own handlers must still stop the
            # server (serve() then exits at once); uvicorn also re-raises the signal it handled after
            # draining, which lands here too and is then harmless.
            server.should_exit = True

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        watchdog = asyncio.create_task(_stop_when_engine_dies(engine, server))
        await server.serve()
    finally:
        if watchdog is not None:
            watchdog.cancel()
        engine_died = engine.is_dead
        if sandbox is not None:
            sandbox.close()
        await engine.shutdown()
    return ENGINE_DEAD_EXIT_CODE if engine_died else 0
