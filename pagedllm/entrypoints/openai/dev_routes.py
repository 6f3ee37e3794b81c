"""The server's operation routes: profiling, and (only with PAGEDLLM_SERVER_DEV_MODE=1, as vLLM's
VLLM_SERVER_DEV_MODE) sleep mode, weight updates and named worker calls.

- `POST /start_profile`, `POST /stop_profile`: when `--profiler-config` names a profiler.
- dev mode: `POST /sleep?level=1|2`, `POST /wake_up[?tags=weights&tags=kv_cache]`, `GET /is_sleeping`,
  `POST /reset_prefix_cache`, `POST /collective_rpc` `{"method", "args", "kwargs", "timeout"}` (a method
  of `RPC_METHODS` only),
  `POST /init_weight_transfer_engine` `{"init_info"}`, `POST /update_weights` `{"update_info"}`,
  `POST /update_weights_from_disk` `{"path"}`.

While the engine sleeps, generation requests are answered 503 (`EngineSleepingError`, OpenAI's error
shape); they are not queued, so a client retries after `/wake_up`.
"""

from __future__ import annotations

from collections.abc import Awaitable
from http import HTTPStatus
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from pagedllm import envs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.utility import EngineSleepingError
from pagedllm.entrypoints.openai.errors import OpenAIError, error_response

T = TypeVar("T")

# The worker methods `/collective_rpc` may name: the weight operations, whose arguments the workers
# check. The others (execute_model, load_model, initialize_kv_cache, shutdown, add_lora, ...) would
# let a client break the engine or bypass the checks of their own routes.
RPC_METHODS = frozenset(
    {"init_weight_transfer_engine", "update_weights", "update_weights_from_disk", "list_loras"}
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CollectiveRpcRequest(_Body):
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None


class InitWeightTransferRequest(_Body):
    init_info: dict[str, Any]


class UpdateWeightsRequest(_Body):
    update_info: dict[str, Any]


class UpdateWeightsFromDiskRequest(_Body):
    path: str


async def _call(work: Awaitable[T]) -> T:
    """The engine's answer; its ValueError (bad arguments, a refused update) becomes a 400."""
    try:
        return await work
    except ValueError as e:
        raise OpenAIError(str(e)) from e


def register_operation_routes(app: FastAPI, engine: AsyncLLM) -> None:
    @app.exception_handler(EngineSleepingError)
    async def _sleeping(_: Request, exc: EngineSleepingError) -> JSONResponse:
        return error_response(
            OpenAIError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE, err_type="EngineSleepingError")
        )

    if engine.engine_config.profiler_config.profiler is not None:

        @app.post("/start_profile")
        async def start_profile() -> Response:
            await _call(engine.call_utility("start_profile"))
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile() -> JSONResponse:
            return JSONResponse({"traces": await _call(engine.call_utility("stop_profile"))})

    if envs.PAGEDLLM_SERVER_DEV_MODE:
        _register_dev_routes(app, engine)


def _register_dev_routes(app: FastAPI, engine: AsyncLLM) -> None:
    @app.post("/sleep")
    async def sleep(level: int = 1) -> Response:
        await _call(engine.sleep(level))
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> Response:
        await _call(engine.wake_up(tags))
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": engine.is_sleeping()})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        return JSONResponse({"reset": bool(await _call(engine.call_utility("reset_prefix_cache")))})

    @app.post("/collective_rpc")
    async def collective_rpc(request: CollectiveRpcRequest) -> JSONResponse:
        if request.method not in RPC_METHODS:
            raise OpenAIError(
                f"method {request.method!r} cannot be called over HTTP; the allowed worker methods are "
                f"{', '.join(sorted(RPC_METHODS))}",
                param="method",
            )
        results = await _call(
            engine.call_utility(
                "collective_rpc", request.method, request.args, request.kwargs, request.timeout
            )
        )
        return JSONResponse({"results": results})

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: InitWeightTransferRequest) -> Response:
        await _call(engine.call_utility("init_weight_transfer_engine", request.init_info))
        return Response(status_code=200)

    @app.post("/update_weights")
    async def update_weights(request: UpdateWeightsRequest) -> JSONResponse:
        return JSONResponse(
            {"loaded": await _call(engine.call_utility("update_weights", request.update_info))}
        )

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: UpdateWeightsFromDiskRequest) -> JSONResponse:
        return JSONResponse(
            {"loaded": await _call(engine.call_utility("update_weights_from_disk", request.path))}
        )
