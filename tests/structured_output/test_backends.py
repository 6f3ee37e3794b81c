"""Backend choice and the front-end's validation of a constraint (no tokenizer needed)."""

from __future__ import annotations

import pytest

from pagedllm.structured_output.backends import resolve_backend
from pagedllm.structured_output.params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "fields",
    [
        {"json": SCHEMA},
        {"json": '{"type": "array", "items": {"type": "string"}}'},
        {"json_object": True},
        {"regex": "[a-z]{2,4}"},
        {"choice": ["yes", 'no "quoted"']},
        {"grammar": 'root ::= "a" b\nb ::= "x" | "y"'},
    ],
)
def test_auto_prefers_xgrammar_and_guidance_takes_the_same(fields: dict) -> None:
    params = StructuredOutputsParams(**fields)
    assert resolve_backend(params, "auto", disable_fallback=False) == "xgrammar"
    assert resolve_backend(params, "guidance", disable_fallback=False) == "guidance"


def test_auto_falls_back_to_guidance_unless_disabled() -> None:
    # A whitespace pattern is a guidance option xgrammar does not have.
    params = StructuredOutputsParams(json=SCHEMA, whitespace_pattern=r"[ ]?")
    assert resolve_backend(params, "auto", disable_fallback=False) == "guidance"
    with pytest.raises(ValueError, match="whitespace_pattern"):
        resolve_backend(params, "auto", disable_fallback=True)
    with pytest.raises(ValueError, match="whitespace_pattern"):
        resolve_backend(params, "xgrammar", disable_fallback=False)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"json": {"type": "objectx"}}, "json"),
        ({"regex": "a(b"}, "regex"),
        ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "guidance"])
def test_invalid_constraint_is_a_value_error_naming_the_field(fields: dict, field: str, backend: str) -> None:
    with pytest.raises(ValueError, match=f"structured_outputs.{field} is invalid"):
        resolve_backend(StructuredOutputsParams(**fields), backend, disable_fallback=False)


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="'outlines' is not supported"):
        resolve_backend(StructuredOutputsParams(regex="a"), "outlines", disable_fallback=False)


def test_spec_is_canonical_for_the_cache() -> None:
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    b = StructuredOutputsParams(json={"a": 2, "b": 1})
    assert a.spec() == b.spec() and a.kind == "json"
    assert StructuredOutputsParams(choice=["x"]).spec() == '["x"]'
