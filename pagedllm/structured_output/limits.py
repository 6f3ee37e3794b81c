"""The bounds on what a request's constraint may ask of a grammar engine, checked before one sees it.

xgrammar converts and compiles without a time limit and cannot be interrupted, and some small inputs
take it minutes (a 90-byte schema with the pattern `[a-z]{1,5000}`, a 100,000-member enum). These checks
are pure Python and linear in the constraint's size, so the server runs them on its event loop; what
they let through converts within a fraction of a second, and compiles within the engine's deadline
(`StructuredOutputsConfig.compile_timeout_s`) or is stopped. The limits are `StructuredOutputsConfig`
fields: the schema's size in bytes and its nesting depth, the enum members, and the regex repetition.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from pagedllm.errors import RequestError
from pagedllm.structured_output.params import StructuredOutputsParams

# A bounded quantifier: {n}, {n,} or {n,m}.
_QUANTIFIER = re.compile(r"\{(\d+)(,(\d*))?\}")


class _Limits(Protocol):
    max_schema_bytes: int
    max_schema_depth: int
    max_enum_members: int
    max_regex_repetition: int


def regex_repetition(pattern: str) -> int:
    """How much repetition ``pattern`` asks for: the sum of its quantifiers' upper bounds, a quantifier
    inside a quantified group multiplied by the group's bound (`(a{1,50}){1,20}` is 1000, `*`, `+` and
    `?` count 1). Unbalanced parentheses are not an error here (the grammar engine reports them)."""
    # One frame per open group: [the weight of the group so far, the weight of its last atom].
    stack: list[list[int]] = [[0, 0]]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        frame = stack[-1]
        if c == "\\":
            frame[1] = 0
            i += 2
            continue
        if c == "[":
            i = _class_end(pattern, i)
            frame[1] = 0
            continue
        if c == "(":
            stack.append([0, 0])
        elif c == ")":
            if len(stack) > 1:
                weight = stack.pop()[0]
                stack[-1][0] += weight
                stack[-1][1] = weight
        elif c in "*+?":
            _repeat(frame, 1)
        elif c == "{" and (m := _QUANTIFIER.match(pattern, i)) is not None:
            _repeat(frame, int(m.group(3) or m.group(1)) if m.group(2) is not None else int(m.group(1)))
            i = m.end()
            continue
        else:
            frame[1] = 0
        i += 1
    return sum(frame[0] for frame in stack)


def _repeat(frame: list[int], bound: int) -> None:
    # The last atom (a character, a class or a group of weight w) repeated `bound` times weighs
    # bound * max(w, 1): it replaces the atom's own weight in the group's sum.
    last = frame[1]
    frame[0] -= last
    frame[1] = bound * max(last, 1)
    frame[0] += frame[1]


def _class_end(pattern: str, start: int) -> int:
    """The index after the `]` closing the character class opened at ``start``."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":  # a leading `]` is a literal
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


class _SchemaCounts:
    """What the limits count in a JSON document (a schema or a structural tag), in one walk."""

    def __init__(self) -> None:
        self.enum_members = 0
        self.repetition = 0
        self.depth = 0

    def walk(self, value: Any, depth: int = 1) -> None:
        # Iterative: a schema nested deeper than Python's recursion limit must be counted, not crash.
        todo: list[tuple[Any, int]] = [(value, depth)]
        while todo:
            node, level = todo.pop()
            if isinstance(node, dict):
                self.depth = max(self.depth, level)
                for key, item in node.items():
                    if key == "enum" and isinstance(item, list):
                        self.enum_members += len(item)
                    elif key == "pattern" and isinstance(item, str):
                        self.repetition += regex_repetition(item)
                    elif key == "patternProperties" and isinstance(item, dict):
                        self.repetition += sum(regex_repetition(str(k)) for k in item)
                    todo.append((item, level + 1))
            elif isinstance(node, list):
                self.depth = max(self.depth, level)
                todo.extend((item, level + 1) for item in node)


def check_limits(params: StructuredOutputsParams, limits: _Limits) -> None:
    """RequestError, naming the constraint and the limit, for a constraint over one of ``limits``."""
    kind = params.kind
    field = f"structured_outputs.{kind}"
    spec = params.spec()
    size = len(spec.encode())
    if size > limits.max_schema_bytes:
        raise RequestError(
            "structured_outputs",
            f"{field} is {size} bytes, more than the {limits.max_schema_bytes} this server accepts "
            "(structured_outputs_config.max_schema_bytes)"
        )
    counts = _SchemaCounts()
    if kind == "json" or kind == "structural_tag":
        counts.walk(json.loads(spec))
    elif kind == "regex":
        counts.repetition = regex_repetition(spec)
    elif kind == "choice":
        assert params.choice is not None
        counts.enum_members = len(params.choice)
    if params.whitespace_pattern is not None:
        counts.repetition += regex_repetition(params.whitespace_pattern)
    if counts.depth > limits.max_schema_depth:
        raise RequestError(
            "structured_outputs",
            f"{field} is nested {counts.depth} levels deep, more than the {limits.max_schema_depth} this "
            "server accepts (structured_outputs_config.max_schema_depth)"
        )
    if counts.enum_members > limits.max_enum_members:
        what = "choices" if kind == "choice" else "enum members"
        raise RequestError(
            "structured_outputs",
            f"{field} has {counts.enum_members} {what}, more than the {limits.max_enum_members} this server "
            "accepts (structured_outputs_config.max_enum_members)"
        )
    if counts.repetition > limits.max_regex_repetition:
        raise RequestError(
            "structured_outputs",
            f"{field} asks for {counts.repetition} regex repetitions (the bounds of its {{n,m}} quantifiers, "
            f"nested ones multiplied), more than the {limits.max_regex_repetition} this server accepts "
            "(structured_outputs_config.max_regex_repetition)"
        )
