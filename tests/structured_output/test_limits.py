"""The limits on a constraint, checked before a grammar engine sees it: the regex repetition measure, each
limit's error naming the field and the setting, ordinary schemas passing under the defaults, and the
shapes that stalled the server refused at once (in microseconds, not the seconds xgrammar takes)."""

from __future__ import annotations

import time

import pytest

from pagedllm.config import StructuredOutputsConfig
from pagedllm.structured_output.limits import check_limits, regex_repetition
from pagedllm.structured_output.params import StructuredOutputsParams

DEFAULTS = StructuredOutputsConfig()
UUID = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"


@pytest.mark.parametrize(
    ("pattern", "repetition"),
    [
        ("abc", 0),
        ("[a-z]{1,5000}", 5000),
        (r"\d{4}-\d{2}-\d{2}", 8),
        (UUID, 32),
        ("(a{1,50}){1,20}", 1000),  # nested: multiplied
        ("((a{2}){3}){4}", 24),
        ("a{1,10}b{1,10}", 20),  # in sequence: summed
        ("(a|aa)*(b|bb)*{0,10000}", 10001),  # a quantifier on a quantifier still counts
        ("x{3,}", 3),
        ("(a|b{7})*", 7),
        ("[{]{1,3}", 3),  # a brace in a class is a character
        ("[]a]{4}", 4),
        (r"\{5\}", 0),  # escaped braces are characters
        ("a{,5}", 0),  # not a quantifier in ECMA-262 either
        ("(a{2}", 2),  # unbalanced: counted, left for the engine to refuse
    ],
)
def test_regex_repetition(pattern: str, repetition: int) -> None:
    assert regex_repetition(pattern) == repetition


def _params(**fields: object) -> StructuredOutputsParams:
    return StructuredOutputsParams(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [
        {
            "json": {
                "type": "object",
                "properties": {f"id{i}": {"type": "string", "pattern": UUID} for i in range(30)},
            }
        },
        {"json": {"enum": [f"v{i}" for i in range(1000)]}},
        {"choice": ["yes", "no"]},
        {"regex": r"[0-9]{3}-[0-9]{4}"},
        {"grammar": 'root ::= "a"{1,100000}'},  # grammars are bounded by size and compile deadline only
        {"json": {"type": "string", "maxLength": 100000}},  # xgrammar counts lengths, it does not unroll
    ],
)
def test_ordinary_constraints_pass_the_defaults(fields: dict) -> None:
    check_limits(_params(**fields), DEFAULTS)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (
            {"json": {"type": "string", "pattern": "[a-z]{1,5000}"}},
            "structured_outputs.json asks for 5000 regex",
        ),
        ({"json": {"type": "string", "pattern": "(a|aa)*(b|bb)*{0,10000}"}}, "max_regex_repetition"),
        (
            {"json": {"type": "object", "patternProperties": {"^x{1,2000}$": {"type": "integer"}}}},
            "max_regex_repetition",
        ),
        # Summed over the schema's patterns: many small ones add up.
        (
            {"json": {"properties": {f"p{i}": {"type": "string", "pattern": ".{1,100}"} for i in range(11)}}},
            "asks for 1100 regex repetitions",
        ),
        ({"regex": ".{1,2000}"}, "structured_outputs.regex asks for 2000"),
        ({"json": {"enum": list(range(100_000))}}, "bytes, more than the 65536 this server accepts"),
        ({"json": {"enum": list(range(1001))}}, "has 1001 enum members, more than the 1000"),
        (
            {"json": {"anyOf": [{"enum": list(range(600))}, {"enum": list(range(600))}]}},
            "has 1200 enum members",
        ),
        ({"choice": [str(i) for i in range(1001)]}, "structured_outputs.choice has 1001 choices"),
        ({"json": _nested(40)}, "structured_outputs.json is nested 81 levels deep, more than the 64"),
        ({"grammar": "root ::= " + " | ".join(f'"{i}"' for i in range(20000))}, "max_schema_bytes"),
        ({"json": {"type": "object"}, "whitespace_pattern": " {0,5000}"}, "max_regex_repetition"),
    ],
)
def test_over_a_limit_is_a_value_error_naming_field_and_setting(fields: dict, words: str) -> None:
    params = _params(**fields)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"^structured_outputs\.") as error:
        check_limits(params, DEFAULTS)
    assert words in str(error.value) and "structured_outputs_config.max_" in str(error.value)
    # Linear in the constraint's size: far from the seconds a grammar engine takes on these.
    assert time.perf_counter() - start < 1.0


def test_limits_are_configurable() -> None:
    big = _params(json={"type": "string", "pattern": "[a-z]{1,5000}"})
    check_limits(big, StructuredOutputsConfig(max_regex_repetition=5000))
    with pytest.raises(ValueError, match="max_enum_members"):
        check_limits(_params(choice=["a", "b", "c"]), StructuredOutputsConfig(max_enum_members=2))
    with pytest.raises(ValueError, match="must be at least 1"):
        StructuredOutputsConfig(max_schema_bytes=0)
    with pytest.raises(ValueError, match="must be positive"):
        StructuredOutputsConfig(validation_timeout_s=0)
    with pytest.raises(ValueError, match="must be positive"):
        StructuredOutputsConfig(compile_timeout_s=0)
