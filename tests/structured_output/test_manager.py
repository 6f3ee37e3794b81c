"""The grammar manager on a tiny byte-level BPE tokenizer (no model): grammars compile on the pool and
are cached, the batched bitmask allows exactly the grammar's continuations, and a matcher driven by it
produces a string of the language and terminates on EOS, for both backends."""

from __future__ import annotations

import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from tiny_llm import build_tokenizer, make_tiny_llm
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
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
        reasoning_parser="",
    )
    # A vocabulary padded past the tokenizer's, as model embeddings often are.
    return StructuredOutputManager(config, len(tokenizer) + 13, [tokenizer.eos_token_id], lambda: tokenizer)


def ready(manager: StructuredOutputManager, fields: dict) -> StructuredOutputRequest:
    params = StructuredOutputsParams(**fields)
    apply_engine_config(params, manager.config)
    grammar = manager.grammar_init(params, [])
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
        grammar = manager.grammar_init(params, [])
        while not grammar.is_ready():
            time.sleep(0.01)
        with pytest.raises(ValueError, match="structured_outputs.regex is invalid"):
            grammar.init_matcher()
    finally:
        manager.shutdown()


# -- with a reasoning parser: the grammar constrains only what follows the reasoning ---------------
THINK, END_THINK = "<think>", "</think>"
REGEX = "[0-9]{2}-(fox|dog)"


@pytest.fixture(scope="module")
def think_tokenizer() -> Any:
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([THINK, END_THINK])
    return tokenizer


def reasoning_manager(tokenizer: Any, parser: str = "deepseek_r1") -> StructuredOutputManager:
    manager = make_manager(tokenizer, "xgrammar")
    manager.config.reasoning_parser = parser
    return manager


def ready_after(manager: StructuredOutputManager, prompt: list[int]) -> StructuredOutputRequest:
    params = StructuredOutputsParams(regex=REGEX)
    apply_engine_config(params, manager.config)
    grammar = manager.grammar_init(params, prompt)
    while not grammar.is_ready():
        time.sleep(0.01)
    grammar.init_matcher()
    return grammar


def test_grammar_waits_for_the_reasoning_end(think_tokenizer: Any) -> None:
    tok = think_tokenizer
    start, end = tok.convert_tokens_to_ids([THINK, END_THINK])
    manager = reasoning_manager(tok)
    try:
        grammar = ready_after(manager, tok.encode("Question?"))
        fresh = ready_after(manager, [*tok.encode("Question?"), start, *tok.encode("hm"), end])
        assert not grammar.reasoning_ended and fresh.reasoning_ended
        # While reasoning: every token allowed, and tokens the grammar forbids are taken without moving it.
        for token in [start, *tok.encode("The quick brown fox is 42")]:
            (row,) = allowed_ids(manager, [grammar])
            assert row == list(range(manager.vocab_size))
            assert grammar.accept_token(token)
        assert grammar.accept_token(end)
        # The matcher starts at the first token after </think>: the same row as a grammar never moved.
        assert allowed_ids(manager, [grammar, fresh]) == allowed_ids(manager, [fresh, fresh])
        assert all(tok.decode([t]).isdigit() for t in allowed_ids(manager, [grammar])[0])
        assert re.fullmatch(REGEX, generate(manager, grammar, tok, 3))
        # A prompt that opens a new reasoning after an earlier turn's end is still reasoning.
        assert not ready_after(manager, [start, end, *tok.encode("Next?"), start]).reasoning_ended
    finally:
        manager.shutdown()


def test_without_marker_tokens_the_grammar_applies_from_the_start(tokenizer: Any) -> None:
    # This vocabulary has no </think> token: the end of the reasoning could never be seen.
    manager = reasoning_manager(tokenizer, "qwen3")
    try:
        grammar = ready_after(manager, tokenizer.encode("Question?"))
        assert manager.reasoner is None and grammar.reasoning_ended
        assert re.fullmatch(REGEX, generate(manager, grammar, tokenizer, 0))
    finally:
        manager.shutdown()


@pytest.fixture(scope="module")
def think_model(tmp_path_factory: pytest.TempPathFactory, think_tokenizer: Any) -> Path:
    """The tiny random Llama with <think> and </think> added to its tokenizer and embeddings."""
    path = make_tiny_llm(tmp_path_factory.mktemp("think_llm"))
    model = AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(len(think_tokenizer))
    model.save_pretrained(path)
    think_tokenizer.save_pretrained(path)
    return path


def test_engine_constrains_only_after_the_reasoning(think_model: Path, think_tokenizer: Any) -> None:
    end = think_tokenizer.convert_tokens_to_ids(END_THINK)
    prompt = think_tokenizer.encode("The quick brown fox")
    constrained = {"structured_outputs": {"regex": REGEX}}
    # A strong bias makes the first token </think>, unless a grammar forbids it.
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **constrained),
        SamplingParams(temperature=0.0, max_tokens=16, logit_bias={end: 100.0}, **constrained),
    ]
    kwargs = {"model": str(think_model), "dtype": "float32", "max_model_len": 128, "enforce_eager": True}
    llm = LLM(reasoning_parser="deepseek_r1", **kwargs)
    prompts = [{"prompt_token_ids": prompt}] * 3
    free, thinking, ended = (o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False))
    (after_prompt,) = llm.generate({"prompt_token_ids": [*prompt, end]}, params[1], use_tqdm=False)
    del llm
    # No </think>: the whole output is reasoning, exactly what the unconstrained model writes.
    assert thinking.token_ids == free.token_ids and not re.fullmatch(REGEX, free.text)
    # </think> passes (the regex forbids it), then the matcher starts: the answer matches the regex.
    assert ended.token_ids[0] == end and re.fullmatch(REGEX, ended.text.removeprefix(END_THINK))
    assert ended.finish_reason == "stop"
    # A prompt that ended the reasoning: constrained from the first token.
    assert re.fullmatch(REGEX, after_prompt.outputs[0].text)
    # Without a reasoning parser the grammar applies at once and the bias cannot produce </think>.
    (plain,) = LLM(**kwargs).generate({"prompt_token_ids": prompt}, params[2], use_tqdm=False)
    assert end not in plain.outputs[0].token_ids and re.fullmatch(REGEX, plain.outputs[0].text)
