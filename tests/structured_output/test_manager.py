"""The grammar manager on a tiny byte-level BPE tokenizer (no model): grammars compile on the pool and
are cached, the batched bitmask allows exactly the grammar's continuations, and a matcher driven by it
produces a string of the language and terminates on EOS, for both backends."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from tiny_llm import build_tokenizer

from pagedllm.structured_output.backends import apply_engine_config
from pagedllm.structured_output.bitmask import forbidden_tokens
from pagedllm.structured_output.manager import StructuredOutputManager, StructuredOutputRequest
from pagedllm.structured_output.params import StructuredOutputsParams


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


def make_manager(tokenizer: Any, backend: str) -> StructuredOutputManager:
    config = SimpleNamespace(
        backend=backend,
        disable_fallback=False,
        disable_any_whitespace=False,
        disable_additional_properties=False,
    )
    # A vocabulary padded past the tokenizer's, as model embeddings often are.
    return StructuredOutputManager(config, len(tokenizer) + 13, [tokenizer.eos_token_id], lambda: tokenizer)


def ready(manager: StructuredOutputManager, fields: dict) -> StructuredOutputRequest:
    params = StructuredOutputsParams(**fields)
    apply_engine_config(params, manager.config)
    grammar = manager.grammar_init(params)
    deadline = time.monotonic() + 60
    while not grammar.is_ready():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    grammar.init_matcher()
    return grammar


def allowed_ids(manager: StructuredOutputManager, grammars: list[StructuredOutputRequest]) -> list[list[int]]:
    bitmask = manager.grammar_bitmask(grammars)
    allowed = ~forbidden_tokens(bitmask, manager.vocab_size)
    return [np.flatnonzero(row).tolist() for row in allowed]


def generate(
    manager: StructuredOutputManager, grammar: StructuredOutputRequest, tokenizer: Any, pick: int
) -> str:
    """Follow the bitmask (the `pick`-th allowed token each step, EOS once it is allowed) to the end."""
    eos = tokenizer.eos_token_id
    tokens: list[int] = []
    for _ in range(64):
        (allowed,) = allowed_ids(manager, [grammar])
        token = eos if eos in allowed else allowed[pick % len(allowed)]
        assert grammar.accept_token(token)
        if token != eos:
            tokens.append(token)
        # xgrammar terminates on accepting EOS, llguidance as soon as nothing but EOS may follow.
        if grammar.is_terminated():
            return tokenizer.decode(tokens)
        assert token != eos
    raise AssertionError("the grammar never terminated")


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_choice_bitmask_and_termination(tokenizer: Any, backend: str) -> None:
    manager = make_manager(tokenizer, backend)
    try:
        choices = ["quick brown", "lazy dog", "Hello"]
        for pick in range(3):
            grammar = ready(manager, {"choice": choices})
            assert generate(manager, grammar, tokenizer, pick) in choices
        (first,) = allowed_ids(manager, [ready(manager, {"choice": choices})])
        # Only tokens that start a choice, never EOS or the padded ids past the tokenizer's vocabulary.
        texts = [tokenizer.decode([t]) for t in first]
        assert texts and all(any(c.startswith(t) for c in choices) for t in texts)
        assert max(first) < len(tokenizer)
    finally:
        manager.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_regex_output_matches(tokenizer: Any, backend: str) -> None:
    manager = make_manager(tokenizer, backend)
    try:
        for pick in (0, 5, 11):
            text = generate(manager, ready(manager, {"regex": "[0-9]{2}-(fox|dog)"}), tokenizer, pick)
            assert len(text) == 6 and text[:2].isdigit() and text[2:] in ("-fox", "-dog"), text
    finally:
        manager.shutdown()


def test_grammars_are_cached_and_rows_are_per_request(tokenizer: Any) -> None:
    manager = make_manager(tokenizer, "xgrammar")
    try:
        a = ready(manager, {"json": {"type": "object", "properties": {"x": {"type": "integer"}}}})
        b = ready(manager, {"json": {"properties": {"x": {"type": "integer"}}, "type": "object"}})
        c = ready(manager, {"regex": "[0-9]+"})
        assert len(manager._cache) == 2 and a.matcher is not b.matcher
        assert a.accept_token(tokenizer.encode("{")[0])
        rows = allowed_ids(manager, [a, b, c])
        # a is past its "{", b is not: their rows differ although they share the compiled grammar.
        assert rows[0] != rows[1] and rows[1] != rows[2]
        assert all(tokenizer.decode([t]).isdigit() for t in rows[2])
    finally:
        manager.shutdown()


def test_a_grammar_that_fails_to_compile_raises_on_init(tokenizer: Any) -> None:
    manager = make_manager(tokenizer, "xgrammar")
    try:
        # The front-end would have refused it; a client talking to the core directly gets the error here.
        params = StructuredOutputsParams(regex="a(b", resolved_backend="xgrammar")
        grammar = manager.grammar_init(params)
        while not grammar.is_ready():
            time.sleep(0.01)
        with pytest.raises(ValueError, match="structured_outputs.regex is invalid"):
            grammar.init_matcher()
    finally:
        manager.shutdown()
