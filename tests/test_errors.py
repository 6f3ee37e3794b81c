"""RequestError and ErrorReport: the field at fault survives every way a refusal travels."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from pagedllm.core.outputs import EngineCoreOutputs
from pagedllm.errors import ErrorReport, RequestError


def test_request_error_is_a_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="top_p must be in") as info:
        raise RequestError("top_p", "top_p must be in (0, 1], got 2")
    assert info.value.param == "top_p" and info.value.message == str(info.value)


def test_request_error_pickles_with_its_field() -> None:
    # Executors and multiprocessing pickle exceptions; the default reduce would lose the field.
    error = pickle.loads(pickle.dumps(RequestError("max_tokens", "too many")))
    assert (type(error), error.param, str(error)) == (RequestError, "max_tokens", "too many")


def test_report_crosses_msgpack_inside_engine_core_outputs() -> None:
    outputs = EngineCoreOutputs(
        errors={
            "a": ErrorReport.of(RequestError("prompt", "The prompt has 600 tokens")),
            "b": ErrorReport.of(KeyError("x"), param="structured_outputs"),
            "c": ErrorReport.of(ValueError("request id 'c' is already in use")),
        }
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(outputs), type=EngineCoreOutputs)
    assert decoded.errors == {
        "a": ErrorReport("The prompt has 600 tokens", "prompt"),
        "b": ErrorReport("KeyError: 'x'", "structured_outputs"),
        "c": ErrorReport("ValueError: request id 'c' is already in use"),
    }
    again = decoded.errors["a"].to_error()
    assert isinstance(again, ValueError) and again.param == "prompt"
