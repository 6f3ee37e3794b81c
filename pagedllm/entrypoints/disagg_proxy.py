"""`pagedllm disagg-proxy --prefill URL --decode URL`: disaggregated prefill behind one OpenAI endpoint.

Each completion or chat request goes first to a prefill instance with `max_tokens=1` (not streamed): it
computes the prompt and, being a KV producer (e.g. SharedStorageConnector with kv_role=kv_producer),
stores the prompt's KV blocks. Then the original request goes to a decode instance (a KV consumer of the
same store), which loads those blocks instead of computing the prefill, and its answer - streamed or
not - is passed through unchanged. A prefill instance that fails or cannot be reached only costs time:
the decode instance then computes the prompt itself; a request it refuses (4xx) is answered with its
error. Several URLs per side are used in turn (round robin), as in vLLM's
toy proxy. The blocks are found by their hash chain, so no kv_transfer_params travel between the two.

With `--api-key` (or PAGEDLLM_API_KEY) every route but /health needs `Authorization: Bearer <key>`, as on
`pagedllm serve`; the instances get `--upstream-api-key` (default: the proxy's own key).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pagedllm.entrypoints.openai.middleware import ApiKeyMiddleware, configured_api_key

logger = logging.getLogger("pagedllm.disagg_proxy")

# Request fields that would stop the prefill request at one token from being valid or cheap.
_PREFILL_OVERRIDES: dict[str, Any] = {"max_tokens": 1, "stream": False, "n": 1}
_PREFILL_DROPPED = ("stream_options", "min_tokens", "max_completion_tokens")
# Headers the proxy passes on to the instances (the rest describe the client's connection).
_FORWARDED_HEADERS = ("authorization", "x-request-id")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "disagg-proxy",
        help="Proxy for disaggregated prefill: prefill on one instance, decode on another.",
        description="An OpenAI-compatible proxy sending each request to a prefill instance (max_tokens=1) "
        "and then to a decode instance; both share KV blocks through a KV connector.",
    )
    parser.add_argument("--prefill", nargs="+", required=True, help="Base URL(s) of the prefill instance(s).")
    parser.add_argument("--decode", nargs="+", required=True, help="Base URL(s) of the decode instance(s).")
    parser.add_argument(
        "--host", default="127.0.0.1", help="Address to listen on (0.0.0.0 for every interface)."
    )
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="Seconds to wait for an instance's answer."
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="Require `Authorization: Bearer <key>` on every route but /health "
        "(default: the PAGEDLLM_API_KEY environment variable, else no key).",
    )
    parser.add_argument(
        "--upstream-api-key",
        default=None,
        help="Key sent to the prefill and decode instances (default: the proxy's own key; with neither, "
        "the client's Authorization header is passed on).",
    )
    return parser


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill instance gets: the same prompt and sampling, one token, not streamed."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out.update(_PREFILL_OVERRIDES)
    return out


def build_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    timeout: float,
    transport: httpx.AsyncBaseTransport | None = None,
    api_key: str | None = None,
    upstream_api_key: str | None = None,
) -> FastAPI:
    """The proxy app (`transport` replaces the network, for tests): ``api_key`` is the key its clients
    must send, ``upstream_api_key`` the one it sends the instances (default ``api_key``)."""
    prefills: Iterator[str] = itertools.cycle([u.rstrip("/") for u in prefill_urls])
    decodes: Iterator[str] = itertools.cycle([u.rstrip("/") for u in decode_urls])
    client = httpx.AsyncClient(timeout=timeout, transport=transport)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="pagedllm disaggregated prefill proxy", lifespan=lifespan)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    upstream_key = upstream_api_key or api_key

    def headers_of(request: Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        if upstream_key is not None:
            headers["authorization"] = f"Bearer {upstream_key}"
        return headers

    async def proxy(request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(
                {"error": {"message": "the body is not JSON", "type": "BadRequestError", "code": 400}}, 400
            )
        headers = headers_of(request)
        prefill_url = next(prefills)
        try:
            prefill = await client.post(f"{prefill_url}{path}", json=prefill_body(body), headers=headers)
            if 400 <= prefill.status_code < 500:
                # The request itself is bad: the decode instance would refuse it just the same.
                return Response(prefill.content, prefill.status_code, media_type="application/json")
            if prefill.status_code != 200:
                logger.warning("prefill instance %s answered %d", prefill_url, prefill.status_code)
        except httpx.HTTPError as e:
            # Without the stored prompt the decode instance computes it itself: slower, still right.
            logger.warning("prefill instance %s unreachable (%s); decoding without it", prefill_url, e)
        try:
            upstream = await client.send(
                client.build_request("POST", f"{next(decodes)}{path}", json=body, headers=headers), stream=True
            )
        except httpx.HTTPError as e:
            return _unavailable(e)
        if body.get("stream") and upstream.status_code == 200:
            return StreamingResponse(
                _passthrough(upstream),
                media_type=upstream.headers.get("content-type", "text/event-stream"),
                background=BackgroundTask(upstream.aclose),
            )
        content = await upstream.aread()
        await upstream.aclose()
        return Response(content, upstream.status_code, media_type=upstream.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        upstream = await client.get(f"{next(decodes)}/v1/models", headers=headers_of(request))
        return Response(upstream.content, upstream.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        for url in [*prefill_urls, *decode_urls]:
            try:
                if (await client.get(f"{url.rstrip('/')}/health")).status_code != 200:
                    return Response(status_code=503)
            except httpx.HTTPError:
                return Response(status_code=503)
        return Response(status_code=200)

    return app


async def _passthrough(upstream: httpx.Response) -> AsyncIterator[bytes]:
    async for chunk in upstream.aiter_raw():
        yield chunk


def _unavailable(error: Exception) -> JSONResponse:
    logger.warning("decode instance unreachable: %s", error)
    message = f"the decode instance is unreachable: {type(error).__name__}: {error}"
    return JSONResponse({"error": {"message": message, "type": "ServiceUnavailableError", "code": 503}}, 503)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    api_key = configured_api_key(args.api_key)
    app = build_app(
        args.prefill, args.decode, args.timeout, api_key=api_key, upstream_api_key=args.upstream_api_key
    )
    logger.info("prefill %s -> decode %s on %s:%d", args.prefill, args.decode, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
