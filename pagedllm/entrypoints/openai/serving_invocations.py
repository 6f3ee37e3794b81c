"""POST /invocations (Amazon SageMaker's inference route): the body's shape picks the endpoint, as in vLLM:
the first of the model's endpoints whose request schema the body validates against answers it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from pydantic import BaseModel, ValidationError

from pagedllm.entrypoints.openai.errors import OpenAIError

# A request schema and the route handler that serves it.
Invocation = tuple[type[BaseModel], Callable[[Any, Request], Awaitable[Any]]]


def add_invocations_route(app: FastAPI, invocations: list[Invocation]) -> None:
    """``invocations`` in order of preference (chat before completions, as vLLM tries them)."""

    @app.post("/invocations")
    async def invoke(body: Annotated[dict[str, Any], Body()], raw: Request) -> Any:
        for schema, handle in invocations:
            try:
                request = schema.model_validate(body)
            except ValidationError:
                continue
            return await handle(request, raw)
        expected = ", ".join(schema.__name__ for schema, _ in invocations)
        raise OpenAIError(f"Cannot find a suitable handler for the request: expected one of {expected}")
