"""StructuredOutputsParams: the constraint of one request (vLLM's shape), validated on construction."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from pagedllm.errors import RequestError

# The constraint kinds; exactly one is set per request.
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    # A JSON schema, as a dict or a JSON string.
    json: dict[str, Any] | str | None = None
    # Any JSON object.
    json_object: bool | None = None
    regex: str | None = None
    # The output is exactly one of these strings.
    choice: list[str] | None = None
    # An EBNF / GBNF grammar, as xgrammar reads it (root rule `root`).
    grammar: str | None = None
    # xgrammar's structural tag, as a JSON string.
    structural_tag: str | None = None
    # JSON without whitespace between tokens (otherwise the model may place any whitespace).
    disable_any_whitespace: bool = False
    # Objects may not carry properties the schema does not name.
    disable_additional_properties: bool = False
    # The regex that JSON whitespace must match (the guidance backend only).
    whitespace_pattern: str | None = None
    # Filled in by the front-end, not by users: the backend chosen for this request ("xgrammar" or
    # "guidance"), so the core compiles with the backend the front-end validated with.
    resolved_backend: str | None = None

    def __post_init__(self) -> None:
        kinds = self.set_kinds()
        if len(kinds) != 1:
            raise RequestError(
                "structured_outputs",
                "structured_outputs needs exactly one of "
                f"{', '.join(KINDS)}; got {', '.join(kinds) if kinds else 'none'}",
            )
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(
                    "structured_outputs",
                    f"structured_outputs.{name} must be True or False, got {getattr(self, name)!r}",
                )
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise RequestError(
                    "structured_outputs", f"structured_outputs.json is not valid JSON: {e}"
                ) from e
            if not isinstance(schema, dict | bool):
                raise RequestError(
                    "structured_outputs", "structured_outputs.json must be a JSON schema (an object)"
                )
        if self.json_object is not None and self.json_object is not True:
            raise RequestError(
                "structured_outputs",
                f"structured_outputs.json_object must be True when set, got {self.json_object!r}",
            )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise RequestError(
                "structured_outputs",
                f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}",
            )
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, str) or (name != "whitespace_pattern" and not value)
            ):
                raise RequestError(
                    "structured_outputs",
                    f"structured_outputs.{name} must be a non-empty string, got {value!r}",
                )

    def set_kinds(self) -> list[str]:
        return [k for k in KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.set_kinds()[0]

    def spec(self) -> str:
        """The constraint as one string (the grammar cache key): schemas canonically serialized."""
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(self.choice)
        value = getattr(self, kind)
        assert isinstance(value, str)
        return value
