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

    def __post_init__(self) -> None:
        if self.reasoning_parser:
            # Imported here: the parsers import the server's protocol, which the config must not load.
            from pagedllm.reasoning import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser, "structured_outputs_config.reasoning_parser")

    def compute_hash(self) -> str:
        return hash_fields(self, ("backend",))
