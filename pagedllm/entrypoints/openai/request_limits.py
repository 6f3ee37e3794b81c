"""Bounds on the size of every request field that has one: a request over a bound is a 400 naming the
field, before any work is done for it (tokenizing, rendering, compiling a grammar, queueing).

Counts follow vLLM where it has a bound (its GPU sampler takes at most 1024 `logit_bias` entries, 1024
`allowed_token_ids` and 128 `stop_token_ids`) and OpenAI's API elsewhere (128 tools, 2048 inputs in one
embeddings request). An operator raises one with `--request-limit NAME=N`; `n` keeps its own flag
(`--max-n-sequences`), and `max_tokens`, `logprobs`/`top_logprobs` and prompt lengths are bounded by
the model's context and `--max-logprobs`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIError


@dataclass(frozen=True)
class SizeLimit:
    default: int
    unit: str
    """What is counted (the error message says "<field> has 3000 <unit>")."""


SIZE_LIMITS: dict[str, SizeLimit] = {
    # Completions: a list of strings or of token-id lists (one token-id list is one prompt).
    "prompt": SizeLimit(2048, "prompts"),
    "messages": SizeLimit(2048, "messages"),
    "tools": SizeLimit(128, "tools"),
    # One tool definition as JSON (its parameters schema becomes a grammar when a call is forced).
    "tool_bytes": SizeLimit(64 * 1024, "bytes"),
    "stop": SizeLimit(64, "strings"),
    # Each stop string (the detokenizer searches every new piece of text for each of them).
    "stop_chars": SizeLimit(1024, "characters"),
    "stop_token_ids": SizeLimit(128, "token ids"),
    "logit_bias": SizeLimit(1024, "entries"),
    "allowed_token_ids": SizeLimit(1024, "token ids"),
    "bad_words": SizeLimit(128, "words"),
    # The pooling routes: embeddings and /pooling inputs, /score texts, /rerank documents.
    "input": SizeLimit(2048, "inputs"),
}


def parse_request_limits(items: Iterable[str] | None) -> dict[str, int]:
    """`--request-limit NAME=N ...` as overrides; ValueError naming the flag for a bad one."""
    overrides: dict[str, int] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or name not in SIZE_LIMITS:
            raise ValueError(
                f"--request-limit takes NAME=N with NAME one of {', '.join(SIZE_LIMITS)}, got {item!r}"
            )
        try:
            overrides[name] = int(value)
        except ValueError:
            raise ValueError(f"--request-limit {name}: {value!r} is not an integer") from None
        if overrides[name] < 1:
            raise ValueError(f"--request-limit {name} must be at least 1, got {overrides[name]}")
    return overrides


@dataclass(frozen=True)
class RequestLimits:
    """The server's bounds: `n` (--max-n-sequences) and the `SIZE_LIMITS`, with the operator's overrides."""

    n: int = 128
    overrides: Mapping[str, int] = field(default_factory=dict)

    def limit(self, name: str) -> int:
        return self.overrides.get(name, SIZE_LIMITS[name].default)

    def check_count(self, param: str, value: Any, name: str | None = None) -> None:
        """400 naming ``param`` when the list, dict or string ``value`` holds more than limit ``name``
        (default: the limit named as the field) allows; None and scalars count as nothing to bound."""
        name = name or param
        if not isinstance(value, list | dict | str):
            return
        bound = self.limit(name)
        if len(value) > bound:
            raise OpenAIError(
                f"{param} has {len(value)} {SIZE_LIMITS[name].unit}, more than this server's "
                f"limit of {bound} (--request-limit {name}=N raises it)",
                param=param,
            )

    def check_sampling(self, request: Any) -> None:
        """The sampling fields shared by completions and chat."""
        stop = [request.stop] if isinstance(request.stop, str) else request.stop
        self.check_count("stop", stop)
        for text in stop or ():
            self.check_count("stop", text, "stop_chars")
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words"):
            self.check_count(name, getattr(request, name))

    def check_tools(self, tools: list[Any] | None) -> None:
        self.check_count("tools", tools)
        for tool in tools or ():
            size = len(json.dumps(tool.model_dump(exclude_none=True)))
            if size > self.limit("tool_bytes"):
                raise OpenAIError(
                    f"tools: the definition of {tool.function.name!r} is {size} bytes of JSON, more than this "
                    f"server's limit of {self.limit('tool_bytes')} (--request-limit tool_bytes=N raises it)",
                    param="tools",
                )
