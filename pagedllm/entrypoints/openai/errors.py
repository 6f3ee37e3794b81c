"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse


class OpenAIError(Exception):
    """An error to answer with a given HTTP status (raised by the serving classes)."""

    def __init__(
        self,
        message: str,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        err_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or _default_type(status)


def _default_type(status: HTTPStatus) -> str:
    if status == HTTPStatus.UNAUTHORIZED:
        return "AuthenticationError"
    if status == HTTPStatus.NOT_FOUND:
        return "NotFoundError"
    if status >= 500:
        return "InternalServerError"
    return "BadRequestError"


def error_response(error: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorInfo(message=error.message, type=error.err_type, param=error.param, code=int(error.status))
    )
    return JSONResponse(body.model_dump(), status_code=int(error.status), headers=headers)


def http_error_response(exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (unknown route, wrong method) in OpenAI's shape rather than ``{"detail"}``."""
    try:
        status = HTTPStatus(exc.status_code)
    except ValueError:  # a status http.HTTPStatus does not know
        status = HTTPStatus.BAD_REQUEST if exc.status_code < 500 else HTTPStatus.INTERNAL_SERVER_ERROR
    message = exc.detail if isinstance(exc.detail, str) and exc.detail else status.phrase
    # Keep headers such as 405's Allow.
    return error_response(OpenAIError(message, status), headers=exc.headers)


def validation_error(exc: RequestValidationError | ValidationError) -> OpenAIError:
    """A 400 naming the field, instead of FastAPI's 422 with pydantic internals.

    Also takes pydantic's own ValidationError, for bodies a route validates by hand."""
    errors: Sequence[Any] = exc.errors()
    if not errors:
        return OpenAIError("Invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return OpenAIError("The request body is not valid JSON")
    # loc is ("body", "field", index or union member, ...); only the top-level field name is stable and
    # meaningful to a client.
    loc = [part for part in first.get("loc", ()) if part != "body"]
    field = loc[0] if loc and isinstance(loc[0], str) else None
    if field is None:
        return OpenAIError("The request body must be a JSON object")
    if first.get("type") == "missing" and len(loc) == 1:
        return OpenAIError(f"{field} is required", param=field)
    same_field = [e for e in errors if [p for p in e.get("loc", ()) if p != "body"][:1] == [field]]
    if len(same_field) > 1:
        # A union type: pydantic reports one error per member; summarise instead of listing them.
        return OpenAIError(f"{field} has an invalid type or value", param=field)
    return OpenAIError(f"{field}: {_plain_message(first.get('msg', 'invalid value'))}", param=field)


def _plain_message(msg: str) -> str:
    # pydantic's "Input should be a valid integer" reads fine; drop its "Value error, " prefixes.
    return msg.removeprefix("Value error, ")
