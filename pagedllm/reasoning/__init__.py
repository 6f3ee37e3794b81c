"""Reasoning parsers: split a reasoning model's output into its reasoning and its answer.

`parser.py` holds the `ReasoningParser` base (complete text, streamed deltas, and the engine's
`is_reasoning_end` on token ids) and the registry by name; `think_parsers.py` the `<think>...</think>`
parsers (`deepseek_r1`, `qwen3`). Light: no torch and nothing of the server (a streamed step is a plain
`ReasoningDelta`), so the config and the server import it freely.
"""

from pagedllm.reasoning.parser import (
    ReasoningDelta,
    ReasoningParser,
    get_reasoning_parser,
    reasoning_parser_names,
)

__all__ = ["ReasoningDelta", "ReasoningParser", "get_reasoning_parser", "reasoning_parser_names"]
