"""Typed errors that callers (the server, the CLI) map without reading messages.

A request error names the request field it is about, so the server answers with that field in the
error's ``param``; a `ModelLoadError` is a broken or unsupported model, reported as one line.

`RequestError` is a ValueError, so callers that catch ValueError (the offline API's users, vLLM's habit)
keep working. It crosses the engine-core process boundary as an `ErrorReport` (a msgspec struct): the
core reports refusals in `EngineCoreOutputs.errors`, and the front-end raises them again with the field.
"""

from __future__ import annotations

import msgspec


class RequestError(ValueError):
    """A request the engine refuses. ``param`` is the field at fault, as the offline API names it
    (SamplingParams' field names, ``prompt`` for the prompt); None when no one field is."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message

    def __reduce__(self) -> tuple[type[RequestError], tuple[str | None, str]]:
        # The default would call RequestError(message) with one argument.
        return (type(self), (self.param, self.message))


class ModelLoadError(ValueError):
    """A model cannot be loaded: missing or corrupt files (the message names the file and, where one is
    at fault, the tensor), unsupported architecture or format. The CLI prints its message instead of a
    traceback, and exits with 1."""


class ErrorReport(msgspec.Struct, array_like=True, omit_defaults=True):
    """A refusal as it travels between processes."""

    message: str
    param: str | None = None

    @classmethod
    def of(cls, error: BaseException, param: str | None = None) -> ErrorReport:
        """The report of any exception: a RequestError as the validator told it, any other with its type
        name and ``param`` (the field the caller knows it is about, if any)."""
        if isinstance(error, RequestError):
            return cls(error.message, error.param)
        return cls(f"{type(error).__name__}: {error}", param)

    def to_error(self) -> RequestError:
        return RequestError(self.param, self.message)
