"""The grammar manager on a tiny byte-level BPE tokenizer (no model): grammars compile on the pool and
are cached, the batched bitmask allows exactly the grammar's continuations, and a matcher driven by it
produces a string of the language and terminates on EOS, for both backends."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from tiny_llm import build_tokenizer, make_tiny_llm
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.config import StructuredOutputsConfig
from pagedllm.structured_output.backends import apply_engine_config
from pagedllm.structured_output.bitmask import forbidden_tokens
from pagedllm.structured_output.cache import GrammarCache
from pagedllm.structured_output.manager import StructuredOutputManager, StructuredOutputRequest
from pagedllm.structured_output.params import StructuredOutputsParams


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


def make_manager(tokenizer: Any, backend: str, **limits: Any) -> StructuredOutputManager:
    config = StructuredOutputsConfig(backend=backend, **limits)
    # A vocabulary padded past the tokenizer's, as model embeddings often are.
    return StructuredOutputManager(config, len(tokenizer) + 13, [tokenizer.eos_token_id], lambda: tokenizer)


@pytest.fixture(scope="module")
def managers(tokenizer: Any) -> Iterator[dict[str, StructuredOutputManager]]:
    """A manager per backend, for the tests that leave it as they found it (each manager starts a compile
    server, which imports the grammar engines: seconds)."""
    made = {backend: make_manager(tokenizer, backend) for backend in ("xgrammar", "guidance")}
    yield made
    for manager in made.values():
        manager.shutdown()


def ready(manager: StructuredOutputManager, fields: dict) -> StructuredOutputRequest:
    params = StructuredOutputsParams(**fields)
    apply_engine_config(params, manager.config)
    grammar = manager.grammar_init(params, [])
    # The first grammar waits for the compile server to start (imports: slow on a loaded machine).
    deadline = time.monotonic() + 300
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
def test_choice_bitmask_and_termination(tokenizer: Any, managers: dict, backend: str) -> None:
    manager = managers[backend]
    choices = ["quick brown", "lazy dog", "Hello"]
    for pick in range(3):
        grammar = ready(manager, {"choice": choices})
        assert generate(manager, grammar, tokenizer, pick) in choices
    (first,) = allowed_ids(manager, [ready(manager, {"choice": choices})])
    # Only tokens that start a choice, never EOS or the padded ids past the tokenizer's vocabulary.
    texts = [tokenizer.decode([t]) for t in first]
    assert texts and all(any(c.startswith(t) for c in choices) for t in texts)
    assert max(first) < len(tokenizer)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_regex_output_matches(tokenizer: Any, managers: dict, backend: str) -> None:
    manager = managers[backend]
    for pick in (0, 5, 11):
        text = generate(manager, ready(manager, {"regex": "[0-9]{2}-(fox|dog)"}), tokenizer, pick)
        assert len(text) == 6 and text[:2].isdigit() and text[2:] in ("-fox", "-dog"), text


def test_grammars_are_cached_and_rows_are_per_request(tokenizer: Any, managers: dict) -> None:
    manager = managers["xgrammar"]
    before = manager.cache_stats()[0]
    a = ready(manager, {"json": {"type": "object", "properties": {"y": {"type": "integer"}}}})
    b = ready(manager, {"json": {"properties": {"y": {"type": "integer"}}, "type": "object"}})
    c = ready(manager, {"regex": "[0-9]+y?"})
    assert manager.cache_stats()[0] == before + 2 and a.matcher is not b.matcher
    assert a._compiled is b._compiled
    assert a.accept_token(tokenizer.encode("{")[0])
    rows = allowed_ids(manager, [a, b, c])
    # a is past its "{", b is not: their rows differ although they share the compiled grammar.
    assert rows[0] != rows[1] and rows[1] != rows[2]
    assert all(tokenizer.decode([t]).isdigit() for t in rows[2])


def test_a_grammar_that_fails_to_compile_raises_on_init(managers: dict) -> None:
    # The front-end would have refused it; a client talking to the core directly gets the error here.
    params = StructuredOutputsParams(regex="a(b", resolved_backend="xgrammar")
    grammar = managers["xgrammar"].grammar_init(params, [])
    wait_ready(grammar, 300)
    with pytest.raises(ValueError, match="structured_outputs.regex is invalid"):
        grammar.init_matcher()


# -- deadlines and the cache's bound ----------------------------------------------------------------
# Compiles for a minute or more with xgrammar on any machine (its token-mask tables for 60,000 strings);
# converting it takes a fraction of a second.
HUGE_ENUM = {"enum": [f"member-{i}" for i in range(60_000)]}
UNBOUNDED = {"max_schema_bytes": 10**7, "max_enum_members": 10**6}


def wait_ready(grammar: StructuredOutputRequest, timeout: float) -> float:
    """Seconds until ``grammar`` is ready (compiled or failed); fails past ``timeout``."""
    start = time.monotonic()
    while not grammar.is_ready():
        assert time.monotonic() - start < timeout, "the grammar was neither compiled nor failed in time"
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_grammar_over_its_deadline_fails_and_its_worker_is_killed(tokenizer: Any) -> None:
    manager = make_manager(tokenizer, "xgrammar", compile_timeout_s=2, **UNBOUNDED)
    try:
        # The compile server and a worker up front, so that the timing below is the compile's alone.
        ready(manager, {"regex": "[0-9]+"})
        server = psutil.Process(manager.compile_client.server_pid())
        start = time.monotonic()
        stuck = [
            manager.grammar_init(StructuredOutputsParams(json={**HUGE_ENUM, "title": str(i)}), []) for i in range(2)
        ]
        time.sleep(1)
        compiling = server.children()
        for grammar in stuck:
            # Generous for a loaded machine, a fraction of what the compile would take.
            wait_ready(grammar, 30)
            with pytest.raises(ValueError, match=r"structured_outputs.json did not compile within 2 s"):
                grammar.init_matcher()
        assert time.monotonic() - start >= 2
        # Their workers were killed, not left compiling.
        assert len(compiling) == 2 and not any(p.is_running() for p in compiling), compiling
        assert wait_ready(manager.grammar_init(_resolved(manager, {"regex": "[a-c]{2}"}), []), 30) < 15
        # A timed-out grammar is not cached as failed: it may compile on a less loaded machine.
        assert manager.cache_stats()[0] == 2
    finally:
        manager.shutdown()
    # The server and its workers are gone with the engine.
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE


def _resolved(manager: StructuredOutputManager, fields: dict) -> StructuredOutputsParams:
    params = StructuredOutputsParams(**fields)
    apply_engine_config(params, manager.config)
    return params


def test_a_slow_grammar_does_not_hold_up_others(tokenizer: Any) -> None:
    manager = make_manager(tokenizer, "xgrammar", compile_timeout_s=60, **UNBOUNDED)
    try:
        ready(manager, {"regex": "[0-9]+"})
        slow = manager.grammar_init(StructuredOutputsParams(json=HUGE_ENUM), [])
        # The second worker takes the next grammars while the first one compiles.
        for i in range(3):
            assert wait_ready(manager.grammar_init(_resolved(manager, {"regex": f"[a-c]{{{i + 1}}}"}), []), 30) < 15
        assert not slow.is_ready()
    finally:
        manager.shutdown()


def test_the_cache_is_bounded_in_bytes_and_evicts_the_least_recently_used(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDLLM_XGRAMMAR_CACHE_MB", "1")
    manager = make_manager(tokenizer, "xgrammar")

    def schema(i: int) -> dict:
        # ~110 kB compiled each on the test vocabulary: 20 of them are twice the bound.
        return {"json": {"enum": [f"s{i}-member-{j}" for j in range(900)]}}

    try:
        keep = ready(manager, schema(0))._compiled
        assert 2**20 // 20 < manager.cache_stats()[1] < 2**20 // 4
        for i in range(1, 20):
            ready(manager, schema(i))
            # The first schema, used again each time, stays: the least recently used others go.
            assert ready(manager, schema(0))._compiled is keep
            entries, total = manager.cache_stats()
            assert total <= 2**20
        assert entries < 11
        # An evicted schema compiles again (a new compilation, not the old entry).
        assert ready(manager, schema(1))._compiled is not None and manager.cache_stats()[1] <= 2**20
    finally:
        manager.shutdown()


def test_grammar_cache_accounting() -> None:
    cache = GrammarCache(max_bytes=100)
    done = [Future() for _ in range(4)]
    for f in done:
        f.set_result(None)
    pending: Future = Future()
    cache.add("pending", pending)
    for i, f in enumerate(done[:3]):
        cache.add(i, f)
        cache.finished(i, f, 40)
    # 120 > 100: the least recently used finished entry (0) went; the pending one is never evicted.
    assert len(cache) == 3 and cache.total_bytes == 80 and cache.get(0) is None and cache.get("pending")
    assert cache.get(1) is done[1]  # now 2 is the least recently used
    cache.add(3, done[3])
    cache.finished(3, done[3], 40)
    assert cache.get(2) is None and cache.total_bytes == 80
    cache.discard(1, done[1])
    assert cache.total_bytes == 40 and len(cache) == 2
    big = Future()
    big.set_result(None)
    cache.add("big", big)
    cache.finished("big", big, 500)  # alone over the bound: not kept
    assert cache.get("big") is None and cache.total_bytes <= 100


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
