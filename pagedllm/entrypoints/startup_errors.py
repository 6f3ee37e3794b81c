"""What the CLI commands print when they cannot start: one line instead of a traceback.

A broken or unsupported model (`ModelLoadError`, raised directly, by a configuration validator, or
reported by the engine core process) exits with 1; any other error of the configuration (a bad flag
value) with 2, as argparse does for its own errors. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

from pydantic import ValidationError

from pagedllm.errors import ModelLoadError

MODEL_ERROR_EXIT = 1
CONFIG_ERROR_EXIT = 2


def _cause(error: BaseException) -> BaseException:
    """The error a configuration validator raised (pydantic wraps it with its own layout)."""
    if isinstance(error, ValidationError):
        for item in error.errors():
            cause = (item.get("ctx") or {}).get("error")
            if isinstance(cause, BaseException):
                return cause
    return error


def one_line(error: BaseException) -> str:
    cause = _cause(error)
    if isinstance(cause, ValidationError):  # a type error pydantic found itself: field and reason
        first = cause.errors()[0]
        return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return " ".join(str(cause).split())


def report_startup_error(command: str, error: BaseException) -> int:
    """Print ``error`` for the user of ``command`` as one line on stderr; the exit status."""
    print(f"pagedllm {command}: error: {one_line(error)}", file=sys.stderr)
    return MODEL_ERROR_EXIT if isinstance(_cause(error), ModelLoadError) else CONFIG_ERROR_EXIT
