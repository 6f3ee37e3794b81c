"""StructuredOutputsConfig: guided decoding (JSON schema, regex, grammar)."""

from __future__ import annotations

from typing import Literal

from pagedllm import envs
from pagedllm.config.utils import config, hash_fields

# vLLM's default for VLLM_XGRAMMAR_CACHE_MB.
_DEFAULT_GRAMMAR_CACHE_MB = 512
# What one grammar compile (or check) worker may allocate beyond what it starts with: far beyond what the
# grammars the limits let by need, far below a host's memory.
_DEFAULT_COMPILE_MEMORY_MB = 2048


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
    compile_timeout_s: float = 30.0
    """Seconds one grammar may take to compile: a compilation running longer is stopped (grammars compile
    in child processes, which are killed and replaced) and the requests waiting for it fail."""

    def __post_init__(self) -> None:
        for name in ("max_schema_bytes", "max_schema_depth", "max_enum_members", "max_regex_repetition"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"structured_outputs_config.{name} must be at least 1, got {getattr(self, name)}"
                )
        for name in ("validation_timeout_s", "compile_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"structured_outputs_config.{name} must be positive, got {getattr(self, name)}"
                )
        if self.reasoning_parser:
            # Imported here: the parsers import the server's protocol, which the config must not load.
            from pagedllm.reasoning import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser, "structured_outputs_config.reasoning_parser")

    @staticmethod
    def grammar_cache_bytes() -> int:
        """The bound of the engine's compiled-grammar cache: PAGEDLLM_XGRAMMAR_CACHE_MB (default 512) MiB."""
        mb = envs.PAGEDLLM_XGRAMMAR_CACHE_MB
        mb = _DEFAULT_GRAMMAR_CACHE_MB if mb is None else mb
        if mb < 0:
            raise ValueError(f"PAGEDLLM_XGRAMMAR_CACHE_MB must be 0 or more, got {mb}")
        return mb * 2**20

    @staticmethod
    def compile_memory_mb() -> int:
        """What a grammar compile worker may allocate beyond what it starts with, in MiB:
        PAGEDLLM_GRAMMAR_COMPILE_MEMORY_MB (default 2048; 0: unbounded)."""
        mb = envs.PAGEDLLM_GRAMMAR_COMPILE_MEMORY_MB
        mb = _DEFAULT_COMPILE_MEMORY_MB if mb is None else mb
        if mb < 0:
            raise ValueError(f"PAGEDLLM_GRAMMAR_COMPILE_MEMORY_MB must be 0 or more, got {mb}")
        return mb

    def compute_hash(self) -> str:
        return hash_fields(self, ("backend",))
