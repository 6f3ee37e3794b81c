"""StructuredOutputsConfig: guided decoding (JSON schema, regex, grammar)."""

from __future__ import annotations

from typing import Literal

from pagedllm.config.utils import config, hash_fields


@config
class StructuredOutputsConfig:
    """Configuration of structured outputs."""

    backend: Literal["auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"] = "auto"
    """Grammar engine used for structured outputs."""
    disable_fallback: bool = False
    """Fail instead of falling back to another backend when one cannot handle a request."""
    disable_any_whitespace: bool = False
    """Generate JSON without whitespace."""
    disable_additional_properties: bool = False
    """Forbid properties not in the JSON schema."""
    reasoning_parser: str = ""
    """Reasoning parser (pagedllm.reasoning): structured output constrains only what follows the reasoning
    section. `--reasoning-parser` sets it together with reasoning_config.reasoning_parser (the chat
    server's reasoning/content split)."""
    max_schema_bytes: int = 65536
    """The largest constraint a request may give, in bytes: its JSON schema (serialized), regex, grammar,
    choice list or structural tag."""
    max_schema_depth: int = 64
    """The deepest nesting of objects and arrays a JSON schema (or structural tag) may have (converting a
    schema takes time that grows with the cube of its depth)."""
    max_enum_members: int = 1000
    """The most `enum` values a constraint may list, over all of its enums together (a choice list counts
    its strings), as OpenAI's structured outputs allow."""
    max_regex_repetition: int = 1000
    """The most repetition a constraint's regexes (a regex, a schema's `pattern`s) may ask for: the upper
    bounds of their `{n,m}` quantifiers, those of nested quantifiers multiplied (`(a{1,50}){1,20}` counts
    1000; `*` and `+` count 1), summed over all of the constraint's patterns. A grammar engine's work
    grows with it (`[a-z]{1,5000}` takes seconds to convert)."""
    validation_timeout_s: float = 10.0
    """Seconds the server's front-end may spend checking one request's constraint (off its event loop);
    a constraint not checked in time is refused (400)."""

    def __post_init__(self) -> None:
        for name in ("max_schema_bytes", "max_schema_depth", "max_enum_members", "max_regex_repetition"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"structured_outputs_config.{name} must be at least 1, got {getattr(self, name)}"
                )
        if not self.validation_timeout_s > 0:
            raise ValueError(
                f"structured_outputs_config.validation_timeout_s must be positive, got {self.validation_timeout_s}"
            )
        if self.reasoning_parser:
            # Imported here: the parsers import the server's protocol, which the config must not load.
            from pagedllm.reasoning import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser, "structured_outputs_config.reasoning_parser")

    def compute_hash(self) -> str:
        return hash_fields(self, ("backend",))
